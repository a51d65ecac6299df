"""Reading `launchctl print gui/$UID/<label>` and `launchctl print-disabled gui/$UID`.

launchctl(1) warns that `print` output "is NOT API in any sense at all", so the parser is
defensive: it reads only the service's top-level `key = value` lines (nested blocks such as
endpoints or event triggers have their own `state =` lines), tracks nesting by braces rather
than indentation, and leaves a field None when it is missing or unreadable.

Shapes seen on real Macs (see tests/service/data/):
    last exit code = (never exited) | 0 | 78: EX_CONFIG
    last terminating signal = Segmentation fault: 11     (replaces the exit-code line)
    state = running | not running | spawn scheduled | xpcproxy | exited
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_KEY_VALUE = re.compile(r"^(?P<key>[^=]+?)\s+=\s+(?P<value>.*)$")
_LEADING_INT = re.compile(r"^(-?\d+)\b")
_TRAILING_INT = re.compile(r"(\d+)\s*$")
_DISABLED_LINE = re.compile(r'^"(?P<label>[^"]+)"\s*=>\s*(?P<value>\w+)$')


@dataclass(frozen=True)
class LaunchdJob:
    """The fields of one `launchctl print` service block that status reports."""

    state: str | None = None
    pid: int | None = None
    runs: int | None = None
    last_exit: str | None = None
    last_exit_code: int | None = None
    last_signal: str | None = None
    last_signal_number: int | None = None
    path: str | None = None
    program: str | None = None
    arguments: list[str] = field(default_factory=list)
    environment: dict[str, str] = field(default_factory=dict)
    exit_timeout: int | None = None
    properties: list[str] = field(default_factory=list)

    @property
    def running(self) -> bool:
        """True while launchd reports a live process for the job."""
        return self.state == "running" and self.pid is not None


def parse_print(text: str) -> LaunchdJob:
    """Parse the output of `launchctl print <service-target>` (the command exited 0)."""
    top: dict[str, str] = {}
    blocks: dict[str, list[str]] = {}
    depth = 0
    block: str | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line == "}":
            depth = max(depth - 1, 0)
            if depth <= 1:
                block = None
            continue
        if line.endswith("{"):
            depth += 1
            if depth == 2:
                block = line[:-1].rstrip(" =").strip()
                blocks[block] = []
            continue
        if depth <= 1:
            match = _KEY_VALUE.match(line)
            if match:
                top.setdefault(match["key"].strip(), match["value"].strip())
        elif depth == 2 and block is not None:
            blocks[block].append(line)
    return _job_from(top, blocks)


def _job_from(top: dict[str, str], blocks: dict[str, list[str]]) -> LaunchdJob:
    last_exit = top.get("last exit code")
    signal = top.get("last terminating signal")
    return LaunchdJob(
        state=top.get("state"),
        pid=_int(top.get("pid")),
        runs=_int(top.get("runs")),
        last_exit=last_exit,
        last_exit_code=_leading_int(last_exit),
        last_signal=signal,
        last_signal_number=_trailing_int(signal),
        path=top.get("path"),
        program=top.get("program"),
        arguments=blocks.get("arguments", []),
        environment=_arrow_map(blocks.get("environment", [])),
        exit_timeout=_leading_int(top.get("exit timeout")),
        properties=[p.strip() for p in top.get("properties", "").split("|") if p.strip()],
    )


def parse_disabled(text: str) -> dict[str, bool]:
    """Parse `launchctl print-disabled <domain>`: label -> True when disabled.

    Newer macOS prints `=> disabled|enabled`, older releases `=> true|false` (true = disabled).
    """
    result: dict[str, bool] = {}
    for raw in text.splitlines():
        match = _DISABLED_LINE.match(raw.strip())
        if match and match["value"] in ("disabled", "true", "enabled", "false"):
            result[match["label"]] = match["value"] in ("disabled", "true")
    return result


def _arrow_map(lines: list[str]) -> dict[str, str]:
    result: dict[str, str] = {}
    for line in lines:
        key, sep, value = line.partition(" => ")
        if sep:
            result[key.strip()] = value.strip()
    return result


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _leading_int(value: str | None) -> int | None:
    match = _LEADING_INT.match(value or "")
    return int(match.group(1)) if match else None


def _trailing_int(value: str | None) -> int | None:
    match = _TRAILING_INT.search(value or "")
    return int(match.group(1)) if match else None
