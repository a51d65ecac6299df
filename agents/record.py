"""The install record: what `agents install` added to which file, kept for uninstall.

It lives at `$MTPLX_HOME/agents/installed.json` (mode 0600) and holds, per agent, the target
it was installed for and, per file, each owned entry with the source text it replaced.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from mtplxd.atomic import write_atomic

from .errors import AgentConfigError

VERSION = 1


def record_path(mtplx_home: Path) -> Path:
    """Where the record of `mtplx_home` lives."""
    return mtplx_home / "agents" / "installed.json"


def load_record(mtplx_home: Path) -> dict[str, Any]:
    """The record's `agents` map (agent name -> its install record); {} when none exists."""
    path = record_path(mtplx_home)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, json.JSONDecodeError) as exc:
        raise AgentConfigError(f"{path} is unreadable ({exc}); move it aside to start a fresh record") from None
    return dict(data.get("agents", {}))


def save_record(mtplx_home: Path, agents: dict[str, Any]) -> None:
    """Write the `agents` map atomically (mode 0600); remove the file when it is empty."""
    path = record_path(mtplx_home)
    if not agents:
        path.unlink(missing_ok=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    body = json.dumps({"version": VERSION, "agents": agents}, indent=2, sort_keys=True) + "\n"
    write_atomic(path, body.encode("utf-8"), mode=0o600)


def now_utc() -> str:
    """The current time as an ISO-8601 UTC string, for `installed_at`."""
    return datetime.now(timezone.utc).replace(microsecond=0).isoformat()
