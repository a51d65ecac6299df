"""service install|uninstall|status: run the daemon at login and after a crash (docs/service.md).

Exit codes: 0 done (status: installed and running), 1 error (no service manager here, a
launchctl/systemctl command failed, a broken config.toml), 3 (status only) not installed or not
running.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from rich.table import Table

from mtplxd.config import ConfigError
from mtplxd.instance import lock_is_held
from mtplxd.paths import Paths
from mtplxctl.client import ControlClient, DaemonNotRunning
from mtplxctl.launchd import ChangeReport, ServiceError, ServiceManager, service_manager
from mtplxctl.output import (key_value_table, EXIT_NOT_RUNNING, EXIT_OK, console, err_console, fail,
                             print_json)

UP_TIMEOUT = 60.0
STOP_TIMEOUT = 30.0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `service` command group."""
    service = subparsers.add_parser("service", help="start the daemon at login (launchd / systemd --user)")
    verbs = service.add_subparsers(dest="verb", metavar="VERB", required=True)
    install = verbs.add_parser("install", help="install and start the login service (idempotent)")
    install.add_argument("--no-wait", action="store_true",
                         help="return once the service manager took it; do not wait for the daemon")
    verbs.add_parser("uninstall", help="stop the service and remove exactly what install added")
    verbs.add_parser("status", help="installed? running? pid, last exit, file")
    for verb in verbs.choices.values():
        verb.add_argument("--json", action="store_true", help="machine-readable output")
    install.set_defaults(func=cmd_install)
    verbs.choices["uninstall"].set_defaults(func=cmd_uninstall)
    verbs.choices["status"].set_defaults(func=cmd_status)


def _manager(strict: bool = False) -> ServiceManager | None:
    manager = service_manager(strict=strict)
    if manager is None:
        raise ServiceError("no supported service manager on this platform "
                           "(launchd on macOS, systemd --user on Linux)",
                           "run the daemon with `mtplxctl start` instead")
    return manager


def _service_failure(exc: ServiceError) -> int:
    return fail(str(exc), exc.hint)


# ---------------------------------------------------------------- install


def cmd_install(args: argparse.Namespace) -> int:
    """Install (or refresh) the login service and, unless --no-wait, wait for the daemon."""
    try:
        manager = _manager(strict=True)
    except ConfigError as exc:
        return fail(f"configuration error: {exc}", "fix it with `mtplxctl config set`, then install again")
    except ServiceError as exc:
        return _service_failure(exc)
    if manager.name == "launchd" and sys.platform == "darwin" and os.geteuid() == 0:
        # gui/0 is nobody's login session: the agent would never load for the real user.
        return fail("run `mtplxctl service install` as yourself, not as root or through sudo")
    paths = Paths.from_env()
    notes: list[str] = []
    try:
        # Before anything changes: a daemon running by hand is left alone when the service
        # could never start (no systemd user session, no launchd GUI domain).
        manager.preflight()
    except ServiceError as exc:
        return _service_failure(exc)
    handed_over = _stop_hand_started_daemon(paths, manager.name)
    if handed_over is not None:
        notes.append(f"stopped mtplxd pid {handed_over} (started by hand) so the service runs it")
    try:
        report = manager.install()
    except ServiceError as exc:
        if handed_over is not None:
            # The unit did not start: give the user back the daemon they had.
            exc = ServiceError(f"{exc}; mtplxd was restarted by hand as before "
                               f"({_restart_by_hand(paths)})", exc.hint)
        return _service_failure(exc)
    daemon = None if args.no_wait else _wait_for_daemon(paths)
    result = {
        "installed": True,
        "manager": manager.name,
        "target": manager.target,
        "file": str(manager.service_file),
        "changed": report.changed,
        "actions": report.actions,
        "notes": notes,
        "log_file": str(manager.spec.log_file),
        "daemon": daemon,
    }
    if args.json:
        print_json(result)
    else:
        _print_install(manager, report, notes, daemon, args.no_wait)
    if daemon is None and not args.no_wait:
        return fail("the service is installed but mtplxd did not answer within "
                    f"{UP_TIMEOUT:.0f}s", "see `mtplxctl service status` and `mtplxctl logs`")
    return EXIT_OK


def _restart_by_hand(paths: Paths) -> str:
    """Start the daemon detached again, as `mtplxctl start` does; says how that went."""
    from mtplxctl.commands.daemon import _launch

    start = argparse.Namespace(host=None, port=None, model=None, depth=None)
    failed = _launch(paths, start)
    return "it did not come back: `mtplxctl start`" if failed else "it is running again"


def _stop_hand_started_daemon(paths: Paths, manager_name: str) -> int | None:
    """Shut down a daemon of this home that the service manager did not start; its pid or None.

    Otherwise the service's daemon would find the instance lock taken and exit at every start.
    """
    client = ControlClient(paths.socket)
    try:
        status = client.call("daemon.status")
    except DaemonNotRunning:
        return None
    if status.get("supervisor") == manager_name:
        return None
    try:
        client.call("daemon.shutdown")
    except DaemonNotRunning:
        pass
    deadline = time.monotonic() + STOP_TIMEOUT
    while lock_is_held(paths.lock_file) and time.monotonic() < deadline:
        time.sleep(0.1)
    return int(status["pid"])


def _wait_for_daemon(paths: Paths) -> dict[str, Any] | None:
    """The daemon's `daemon.status` once it answers, or None after UP_TIMEOUT."""
    client = ControlClient(paths.socket)
    deadline = time.monotonic() + UP_TIMEOUT
    with console.status("waiting for mtplxd…", spinner="dots"):
        while time.monotonic() < deadline:
            try:
                return client.call("daemon.status")
            except DaemonNotRunning:
                time.sleep(0.1)
    return None


def _print_install(manager: ServiceManager, report: ChangeReport, notes: list[str],
                   daemon: dict[str, Any] | None, no_wait: bool) -> None:
    for note in notes:
        err_console.print(f"[yellow]{note}[/]")
    for action in report.actions:
        console.print(f"[dim]$ {action}[/]" if not action.startswith(("wrote", "removed"))
                      else f"[dim]{action}[/]")
    verb = "installed" if report.changed else "already installed (unchanged)"
    console.print(f"{manager.name} service {verb}: [bold]{manager.target}[/]")
    if daemon is not None:
        console.print(f"mtplxd running (pid {daemon['pid']}, supervisor "
                      f"{daemon.get('supervisor') or 'none'}) — API [bold]{daemon['http']['base_url']}[/]")
    elif no_wait:
        console.print("not waiting for the daemon; check with `mtplxctl status`")
    console.print(f"[dim]service output: {manager.spec.log_file}; daemon log: `mtplxctl logs`[/]")


# ---------------------------------------------------------------- uninstall


def cmd_uninstall(args: argparse.Namespace) -> int:
    """Stop the service and remove its file; exit 0 also when nothing was installed."""
    try:
        manager = _manager()
        report = manager.uninstall()
    except ServiceError as exc:
        return _service_failure(exc)
    if args.json:
        print_json({"uninstalled": report.changed, "manager": manager.name,
                    "file": str(manager.service_file), "actions": report.actions})
        return EXIT_OK
    for action in report.actions:
        console.print(f"[dim]{action}[/]" if action.startswith("removed") else f"[dim]$ {action}[/]")
    if report.changed:
        console.print(f"{manager.name} service removed; mtplxd no longer starts at login")
    else:
        console.print(f"no {manager.name} service installed ({manager.service_file}); nothing to do")
    return EXIT_OK


# ---------------------------------------------------------------- status


def cmd_status(args: argparse.Namespace) -> int:
    """Show the service state; exit 0 when installed and running, 3 otherwise."""
    try:
        manager = _manager()
        status = manager.status()
    except ServiceError as exc:
        return _service_failure(exc)
    if args.json:
        print_json(status.to_json())
    else:
        console.print(_status_table(status))
        for hint in _hints(status):
            console.print(f"[yellow]→ {hint}[/]")
    return EXIT_OK if status.installed and status.running else EXIT_NOT_RUNNING


def _status_table(status: Any) -> Table:
    table = key_value_table()
    table.add_row("manager", f"{status.manager} ({status.target})")
    if not status.installed:
        table.add_row("installed", f"no ({status.file} does not exist)")
    else:
        current = "up to date" if status.up_to_date else "differs from what install would write now"
        table.add_row("installed", f"yes, {status.file} ({current})")
    table.add_row("loaded", "yes" if status.loaded else "no")
    if status.enabled is not None:
        table.add_row("enabled", "yes" if status.enabled else "no")
    state = status.state or "-"
    table.add_row("state", f"{state}, pid {status.pid}" if status.running else state)
    if status.last_exit or status.last_signal:
        table.add_row("last exit", status.last_signal or status.last_exit)
    if status.runs is not None:
        table.add_row("runs" if status.manager == "launchd" else "restarts", str(status.runs))
    if status.program:
        missing = "" if status.program_exists else "  (missing!)"
        table.add_row("command", " ".join(status.program) + missing)
    if status.home:
        table.add_row("home", status.home)
    table.add_row("output", status.log_file or "-")
    return table


def _hints(status: Any) -> list[str]:
    hints: list[str] = []
    if not status.installed:
        hints.append("install it with `mtplxctl service install`")
        return hints
    if status.program_exists is False:
        hints.append("the Python it runs is gone (venv moved or Python upgraded): "
                     "`mtplxctl service install` again")
    elif status.up_to_date is False:
        hints.append("`mtplxctl service install` rewrites it for the current Python and settings")
    if status.serves_this_home is False:
        hints.append(f"it runs the daemon of MTPLX_HOME={status.home}, not the one this shell "
                     "uses; `mtplxctl start` here will not go through it")
    if not status.running:
        hints.append("start it with `mtplxctl start`; see `mtplxctl logs` for why it stopped")
    return hints
