"""doctor: is the daemon up and serving, and does every installed agent still point at it?"""

from __future__ import annotations

import argparse
import os
from typing import Any, Mapping

from mtplxd.paths import Paths
from mtplxctl.agents.checks import FAIL, OK, WARN, Check, check_agent
from mtplxctl.agents.errors import AgentConfigError
from mtplxctl.agents.record import load_record
from mtplxctl.client import ControlClient, ControlError, DaemonNotRunning
from mtplxctl.output import (
    EXIT_ERROR, EXIT_NOT_RUNNING, EXIT_OK, console, fail, print_json, wrapping_table,
)

_STYLE = {OK: "[green]ok[/]", WARN: "[yellow]warn[/]", FAIL: "[red]fail[/]"}


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `doctor` command."""
    doctor = subparsers.add_parser("doctor", help="check the daemon and every installed agent config")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.set_defaults(func=cmd_doctor)


def diagnose(status: dict[str, Any] | None, records: dict[str, Any], env: Mapping[str, str],
             local_blas: dict[str, Any] | None = None) -> list[Check]:
    """All checks for a daemon `status` (None when it is not running) and the install records;
    `local_blas` is this machine's BLAS check (mtplxd.blas.diagnose) when no daemon reports one."""
    checks = [daemon_check(status)]
    if not records:
        checks.append(Check("agents", "installed", WARN, "no agent installed: run `mtplxctl agents install`"))
    for name in sorted(records):
        checks.extend(check_agent(name, records[name], status, env))
    checks.append(blas_check((status or {}).get("blas") or local_blas))
    return checks


def daemon_check(status: dict[str, Any] | None) -> Check:
    """Whether the daemon answers and serves a loaded model."""
    if status is None:
        return Check("daemon", "running", FAIL, "mtplxd is not running: start it with `mtplxctl start`")
    model = status.get("model")
    if not model:
        return Check("daemon", "model", WARN, "running, but no model is loaded: `mtplxctl start --model <id>`")
    if model.get("state") != "loaded":
        return Check("daemon", "model", WARN, f"running; the model is {model.get('state')}")
    return Check("daemon", "model", OK, f"serving {model.get('id')} at {(status.get('http') or {}).get('base_url')}")


def blas_check(blas: dict[str, Any] | None) -> Check:
    """Whether MLX's CPU matmuls run on an optimized BLAS (warn, with the fix, when not)."""
    if blas is None:
        return Check("daemon", "blas", WARN, "not checked")
    summary = blas.get("summary") or blas.get("kind", "?")
    return Check("daemon", "blas", WARN if blas.get("degraded") else OK, summary)


def exit_code(checks: list[Check], daemon_running: bool) -> int:
    """3 when the daemon is down, 1 when any check failed, else 0."""
    if not daemon_running:
        return EXIT_NOT_RUNNING
    return EXIT_ERROR if any(c.level == FAIL for c in checks) else EXIT_OK


def _local_blas() -> dict[str, Any]:
    from mtplxd import blas

    found = blas.diagnose()  # what a daemon started now would get, checked in a child
    return {**found.to_dict(), "summary": found.summary()}


def cmd_doctor(args: argparse.Namespace) -> int:
    """Run every check and print a table (or JSON)."""
    try:
        status = ControlClient.from_env(timeout=10).call("daemon.status")
    except DaemonNotRunning:
        status = None
    except ControlError as exc:
        return fail(f"the daemon answered daemon.status with an error: {exc.message}", "see `mtplxctl logs`")
    try:
        records = load_record(Paths.from_env().home)
    except AgentConfigError as exc:
        return fail(str(exc))
    local_blas = None if status and status.get("blas") else _local_blas()
    checks = diagnose(status, records, dict(os.environ), local_blas)
    code = exit_code(checks, status is not None)
    if args.json:
        print_json({"ok": code == EXIT_OK, "checks": [c.to_json() for c in checks]})
        return code
    table = wrapping_table("", "check", "result", "detail", title="mtplxctl doctor")
    for check in checks:
        table.add_row(check.agent, check.name, _STYLE[check.level], check.detail)
    console.print(table)
    return code
