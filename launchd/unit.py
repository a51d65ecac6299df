"""The systemd user unit (`mtplxd.service`): rendering, and reading back what it says.

Type=notify: the daemon sends READY=1 once its control socket and HTTP listen (mtplxd/daemon.py),
so `systemctl --user start` returns when `mtplxctl` can talk to it. NotifyAccess=main accepts
that message only from the daemon process itself. Restart=on-failure restarts after a crash or
a signal death, not after a clean exit 0 or `systemctl stop`; the start limit keeps a daemon
that dies at every start (out of memory, a broken model) from spinning forever.

Quoting follows systemd.syntax(7): a word with spaces, quotes or backslashes is double-quoted
with C escapes; `%` is doubled everywhere (specifiers) and `$` is doubled in ExecStart
(variable expansion).
"""

from __future__ import annotations

import re
import shlex

from .spec import ServiceSpec

RESTART_SECONDS = 3
START_LIMIT_INTERVAL_SECONDS = 300
START_LIMIT_BURST = 5

_NEEDS_QUOTES = re.compile(r'[\s"\'\\;]')


def render_unit(spec: ServiceSpec) -> str:
    """The unit file text for `spec`."""
    exec_start = " ".join(_word(arg, dollar=True) for arg in spec.program)
    exec_restore = " ".join(_word(arg, dollar=True) for arg in fans_restore_program(spec.program))
    environment = [f"Environment={_word(f'{k}={v}')}"
                   for k, v in spec.environment_for("systemd").items()]
    log_file = _specifiers(str(spec.log_file))
    lines = [
        "# Written by `mtplxctl service install`; `mtplxctl service uninstall` removes it.",
        "# Install again after upgrading Python, moving MTPLX_HOME or changing shutdown_grace_seconds.",
        "[Unit]",
        "Description=mtplx daemon: a local LLM server for coding agents",
        f"StartLimitIntervalSec={START_LIMIT_INTERVAL_SECONDS}",
        f"StartLimitBurst={START_LIMIT_BURST}",
        "",
        "[Service]",
        "Type=notify",
        "NotifyAccess=main",
        f"ExecStart={exec_start}",
        # Runs after every exit, a crash or an OOM kill included: with KillMode=control-group the
        # fan watchdog dies with the unit, so systemd gives the fans back itself. "-": a failed
        # restore is logged and never blocks the restart.
        f"ExecStopPost=-{exec_restore}",
        *environment,
        "Restart=on-failure",
        f"RestartSec={RESTART_SECONDS}",
        f"TimeoutStopSec={spec.stop_timeout_seconds}",
        f"StandardOutput=append:{log_file}",
        f"StandardError=append:{log_file}",
        "",
        "[Install]",
        "WantedBy=default.target",
        "",
    ]
    return "\n".join(lines)


def fans_restore_program(program: list[str]) -> list[str]:
    """`mtplxctl fans restore` run by the daemon's own interpreter."""
    return [program[0], "-m", "mtplxctl", "fans", "restore"]


def parse_unit(text: str) -> dict[str, list[str]]:
    """`Key=value` lines of a unit file, as key -> raw values in file order (sections merged)."""
    values: dict[str, list[str]] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, sep, value = line.partition("=")
        if sep:
            values.setdefault(key.strip(), []).append(value.strip())
    return values


def unit_words(value: str, dollar: bool = False) -> list[str]:
    """Split an ExecStart= (`dollar=True`) or Environment= value as systemd does, for the
    quoting render writes."""
    words = [word.replace("%%", "%") for word in shlex.split(value)]
    return [word.replace("$$", "$") for word in words] if dollar else words


def unit_environment(values: dict[str, list[str]]) -> dict[str, str]:
    """The variables set by the Environment= lines of a parsed unit."""
    env: dict[str, str] = {}
    for value in values.get("Environment", []):
        for assignment in unit_words(value):
            key, sep, item = assignment.partition("=")
            if sep:
                env[key] = item
    return env


def _specifiers(text: str) -> str:
    return text.replace("%", "%%")


def _word(text: str, dollar: bool = False) -> str:
    escaped = _specifiers(text)
    if dollar:
        escaped = escaped.replace("$", "$$")
    if not text or _NEEDS_QUOTES.search(text):
        escaped = escaped.replace("\\", "\\\\").replace('"', '\\"')
        return f'"{escaped}"'
    return escaped
