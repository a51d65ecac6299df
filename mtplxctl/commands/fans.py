"""fans auto|max|smart|status|restore: fan control from the command line."""

from __future__ import annotations

import argparse
import time
from typing import Any

from rich.table import Table

from mtplxd.config import set_in_file
from mtplxd.fans.base import FanError
from mtplxd.fans.lease import restore_stale_lease
from mtplxd.instance import lock_is_held
from mtplxd.paths import Paths
from mtplxctl.client import ControlClient, ControlError, DaemonNotRunning
from mtplxctl.output import (
    key_value_table, EXIT_ERROR, EXIT_OK, console, fail, not_running, print_json,
)

MODE_HELP = {
    "auto": "leave the fans to the system (never touch them)",
    "max": "full speed while mtplxd serves",
    "smart": "full speed while requests run, automatic after fan_idle_minutes idle",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    fans = subparsers.add_parser("fans", help="fan mode, speeds and temperatures")
    verbs = fans.add_subparsers(dest="verb", metavar="VERB", required=True)
    for mode, text in MODE_HELP.items():
        verb = verbs.add_parser(mode, help=text)
        verb.add_argument("--save", action="store_true",
                          help="also make it the default (config key fan_mode)")
        verb.add_argument("--json", action="store_true", help="machine-readable output")
        verb.set_defaults(func=cmd_set, mode=mode)
    status = verbs.add_parser("status", help="mode, who holds control, speeds, temperatures")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.set_defaults(func=cmd_status)
    restore = verbs.add_parser(
        "restore", help="give back fans a crashed mtplxd left pinned (when it is not running)")
    restore.add_argument("--json", action="store_true", help="machine-readable output")
    restore.set_defaults(func=cmd_restore)


def cmd_set(args: argparse.Namespace) -> int:
    paths = Paths.from_env()
    if args.save:
        set_in_file(paths.config_file, "fan_mode", args.mode)
    saved = " (saved as the default)" if args.save else ""
    try:
        answer = ControlClient(paths.socket).call("fans.set", {"mode": args.mode}, timeout=120)
    except DaemonNotRunning:
        if args.save:
            return _answer(args, args.mode, "saved as the default; it applies when mtplxd starts",
                           saved=True, running=False)
        return not_running(args.json)
    except ControlError as exc:
        return _answer(args, args.mode, exc.message, fans=exc.data.get("fans"), saved=args.save,
                       error=exc.reason)
    return _answer(args, args.mode, f"{answer['control']} holds control{saved}", fans=answer,
                   saved=args.save)


def _answer(args: argparse.Namespace, action: str, message: str, *, fans: dict[str, Any] | None = None,
            saved: bool = False, error: str | None = None, running: bool = True) -> int:
    """Every `fans max|smart|auto|restore` answer, in one shape: a line for people, or
    {action, ok, error, message, mode, control, saved, running, fans} for scripts."""
    if args.json:
        print_json({"action": action, "ok": error is None, "error": error, "message": message,
                    "mode": (fans or {}).get("mode", action if action in MODE_HELP else None),
                    "control": (fans or {}).get("control"), "saved": saved, "running": running,
                    "fans": fans})
        return EXIT_OK if error is None else EXIT_ERROR
    if error is not None:
        return fail(f"fans {action}: {message}", "`mtplxctl fans status` shows what the daemon "
                    "sees; docs/fans.md says what each platform needs")
    console.print(f"fans {action}: {message}")
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    try:
        answer = ControlClient.from_env().call("fans.status", timeout=60)
    except DaemonNotRunning:
        return not_running(args.json)
    if args.json:
        print_json(answer)
        return EXIT_OK
    console.print(status_table(answer))
    return EXIT_OK


def status_table(fans: dict[str, Any]) -> Table:
    """The human view of `fans.status`."""
    table = key_value_table()
    table.add_row("mode", f"{fans['mode']} — {MODE_HELP.get(fans['mode'], '')}")
    table.add_row("control", fans["control"])
    holder = fans.get("holder")
    if holder:
        since = time.strftime("%H:%M:%S", time.localtime(holder["since"]))
        table.add_row("lease", f"{holder['lease']} (since {since}, watchdog pid "
                      f"{holder.get('watchdog_pid') or '-'})")
    backend = fans["backend"] if fans["controllable"] else f"{fans['backend']}: {fans['reason']}"
    table.add_row("backend", backend)
    if fans.get("release_in_seconds") is not None:
        table.add_row("idle", f"automatic again in {fans['release_in_seconds']:.0f}s without requests")
    if fans.get("error"):
        table.add_row("error", f"[red]{fans['error']}[/]")
    if fans.get("stale_lease_restored"):
        table.add_row("at start", fans["stale_lease_restored"])
    for fan in fans.get("fans", []):
        table.add_row("fan", _fan_text(fan))
    for temp in fans.get("temperatures", []):
        table.add_row("temp", f"{temp['name']}: {temp['celsius']:.1f} °C")
    if not fans.get("fans") and not fans.get("temperatures"):
        table.add_row("sensors", "no fan or temperature readings here")
    return table


def summary_line(fans: dict[str, Any]) -> str:
    """One line for `mtplxctl status`: mode, who holds control, hottest reading, any error."""
    parts = [f"{fans['mode']}, {fans['control']}"]
    if not fans.get("controllable"):
        parts.append(f"not controllable: {fans.get('reason')}")
    speeds = [fan["rpm"] for fan in fans.get("fans", []) if fan.get("rpm") is not None]
    if speeds:
        parts.append(f"{max(speeds):.0f} rpm")
    temperatures = [temp["celsius"] for temp in fans.get("temperatures", [])]
    if temperatures:
        parts.append(f"{max(temperatures):.1f} °C")
    if fans.get("error"):
        parts.append(f"error: {fans['error']}")
    return ", ".join(parts)


def _fan_text(fan: dict[str, Any]) -> str:
    parts = [fan["name"] + ":"]
    if fan.get("rpm") is not None:
        parts.append(f"{fan['rpm']:.0f} rpm")
    if fan.get("target_rpm") is not None:
        parts.append(f"target {fan['target_rpm']:.0f}")
    if fan.get("max_rpm") is not None:
        parts.append(f"max {fan['max_rpm']:.0f}")
    if fan.get("mode"):
        parts.append(fan["mode"])
    if fan.get("detail"):
        parts.append(f"({fan['detail']})")
    return " ".join(parts)


def cmd_restore(args: argparse.Namespace) -> int:
    paths = Paths.from_env()
    if lock_is_held(paths.lock_file):
        return fail("mtplxd is running and holds the fans itself",
                    "use `mtplxctl fans auto` to give them back now")
    try:
        done = restore_stale_lease(paths.fans_lease)
    except FanError as exc:
        return _answer(args, "restore", f"could not restore the fans: {exc}; the lease stays, so "
                       "the next mtplxd start tries again", error="fan_control_failed",
                       running=False)
    return _answer(args, "restore", done or f"nothing to restore (no lease at {paths.fans_lease})",
                   running=False)
