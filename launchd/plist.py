"""The per-user LaunchAgent plist, built with plistlib and checked before it is written.

Keys (launchd.plist(5)): RunAtLoad starts the daemon at login; KeepAlive {SuccessfulExit: false}
restarts it after a crash or a signal death but not after a clean exit 0; ThrottleInterval
spaces those restarts; ProcessType Interactive lifts the CPU/IO throttling launchd applies to
background jobs; ExitTimeOut is how long launchd waits after SIGTERM before SIGKILL.
"""

from __future__ import annotations

import plistlib
from typing import Any

from .spec import ServiceSpec


def build_plist(spec: ServiceSpec) -> dict[str, Any]:
    """The plist dictionary for `spec`."""
    log_file = str(spec.log_file)
    return {
        "Label": spec.label,
        "ProgramArguments": list(spec.program),
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": spec.throttle_seconds,
        "ProcessType": "Interactive",
        "ExitTimeOut": spec.stop_timeout_seconds,
        "EnvironmentVariables": {"PATH": spec.launchd_path, **spec.environment_for("launchd")},
        "StandardOutPath": log_file,
        "StandardErrorPath": log_file,
    }


def render_plist(spec: ServiceSpec) -> bytes:
    """The plist as XML bytes (sorted keys, so the same spec always gives the same bytes)."""
    plist = build_plist(spec)
    problems = plist_problems(plist)
    if problems:
        raise ValueError("invalid LaunchAgent plist: " + "; ".join(problems))
    return plistlib.dumps(plist, fmt=plistlib.FMT_XML, sort_keys=True)


def plist_problems(plist: dict[str, Any]) -> list[str]:
    """What launchd would reject or misread in `plist` (empty when it is fine).

    plistlib checks the syntax; this checks the semantics launchd needs and `plutil -lint`
    does not know: types, absolute paths (launchd does no `~` or `$VAR` expansion).
    """
    problems: list[str] = []
    if not isinstance(plist.get("Label"), str) or not plist.get("Label"):
        problems.append("Label must be a non-empty string")
    program = plist.get("ProgramArguments")
    if not isinstance(program, list) or not program or not all(isinstance(a, str) for a in program):
        problems.append("ProgramArguments must be a non-empty list of strings")
    elif not program[0].startswith("/"):
        problems.append(f"ProgramArguments[0] must be an absolute path, not {program[0]!r}")
    keep_alive = plist.get("KeepAlive")
    if not isinstance(keep_alive, (bool, dict)):
        problems.append("KeepAlive must be a bool or a dict")
    for key in ("ThrottleInterval", "ExitTimeOut"):
        value = plist.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            problems.append(f"{key} must be a non-negative integer")
    env = plist.get("EnvironmentVariables", {})
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        problems.append("EnvironmentVariables must map names to strings")
    for key in ("StandardOutPath", "StandardErrorPath"):
        value = plist.get(key)
        if value is not None and (not isinstance(value, str) or not value.startswith("/")):
            problems.append(f"{key} must be an absolute path")
    return problems
