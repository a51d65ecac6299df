"""config get|set: read and change config.toml (through the daemon when it runs)."""

from __future__ import annotations

import argparse
from typing import Any

from rich.table import Table

from mtplxd.config import SETTINGS, ConfigError, load_config, set_in_file
from mtplxd.paths import Paths
from mtplxctl.client import ControlClient, ControlError, DaemonNotRunning
from mtplxctl.output import EXIT_OK, console, fail, print_json


def register(subparsers: argparse._SubParsersAction) -> None:
    config = subparsers.add_parser("config", help="read or change settings (config.toml)")
    verbs = config.add_subparsers(dest="verb", metavar="VERB", required=True)
    get = verbs.add_parser("get", help="show settings and where each value comes from")
    get.add_argument("key", nargs="?", help="one setting (default: all)")
    get.add_argument("--json", action="store_true", help="machine-readable output")
    get.set_defaults(func=cmd_get)
    set_ = verbs.add_parser("set", help="change a setting (an empty VALUE restores the default)")
    set_.add_argument("key", help=f"one of: {', '.join(SETTINGS)}")
    set_.add_argument("value")
    set_.add_argument("--json", action="store_true", help="machine-readable output")
    set_.set_defaults(func=cmd_set)


def _via_daemon(method: str, params: dict[str, Any]) -> dict[str, Any] | None:
    """The daemon's answer, or None when it is not running (then the file is used directly)."""
    try:
        return ControlClient.from_env().call(method, params)
    except DaemonNotRunning:
        return None


def cmd_get(args: argparse.Namespace) -> int:
    paths = Paths.from_env()
    try:
        answer = _via_daemon("config.get", {"key": args.key} if args.key else {})
        if answer is None:
            table = load_config(paths.config_file).to_dict()
            if args.key and args.key not in table:
                raise ConfigError(f"unknown setting {args.key!r}; known: {', '.join(sorted(SETTINGS))}")
            settings = {args.key: table[args.key]} if args.key else table
            answer = {"settings": settings, "file": str(paths.config_file)}
    except (ConfigError, ControlError) as exc:
        return fail(str(exc), "`mtplxctl config get` lists the known settings")
    if args.json:
        print_json(answer)
        return EXIT_OK
    table = Table("setting", "value", "source", "meaning")
    for key, entry in answer["settings"].items():
        table.add_row(key, repr(entry["value"]), entry["source"], SETTINGS[key].doc)
    console.print(table)
    console.print(f"[dim]file: {answer['file']}; environment overrides: MTPLX_<SETTING>[/]")
    return EXIT_OK


def cmd_set(args: argparse.Namespace) -> int:
    paths = Paths.from_env()
    try:
        answer = _via_daemon("config.set", {"key": args.key, "value": args.value})
        if answer is None:
            value = set_in_file(paths.config_file, args.key, args.value)
            answer = {"key": args.key, "value": value, "restart_required": False}
    except (ConfigError, ControlError) as exc:
        return fail(str(exc), "`mtplxctl config get` lists the known settings")
    if args.json:
        print_json(answer)
    else:
        shown = "default" if answer["value"] is None else repr(answer["value"])
        console.print(f"{args.key} = {shown}")
        if answer.get("restart_required"):
            console.print("[yellow]takes effect after `mtplxctl restart`[/]")
    return EXIT_OK
