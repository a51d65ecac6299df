"""key show|rotate: the HTTP API key (OS keychain through keyring, else a 0600 file).

The key is needed when the daemon listens on anything but loopback; clients send it as
`Authorization: Bearer KEY` or `x-api-key: KEY`. This works without a running daemon; a
running one reads the key at start, so `rotate` says when a restart is needed.
"""

from __future__ import annotations

import argparse

from mtplxd.api.auth import load_key, rotate_key
from mtplxd.paths import Paths
from mtplxctl.client import ControlClient, ControlError, DaemonNotRunning
from mtplxctl.output import EXIT_ERROR, EXIT_OK, console, fail, print_json


def register(subparsers: argparse._SubParsersAction) -> None:
    key = subparsers.add_parser("key", help="show or rotate the HTTP API key")
    verbs = key.add_subparsers(dest="verb", metavar="VERB", required=True)
    show = verbs.add_parser("show", help="print the API key and where it is kept")
    show.add_argument("--json", action="store_true", help="machine-readable output")
    show.set_defaults(func=cmd_show)
    rotate = verbs.add_parser("rotate", help="create a new API key (the old one stops working)")
    rotate.add_argument("--json", action="store_true", help="machine-readable output")
    rotate.set_defaults(func=cmd_rotate)


def cmd_show(args: argparse.Namespace) -> int:
    stored = load_key(Paths.from_env())
    if stored is None:
        if args.json:
            print_json({"key": None, "source": None})
            return EXIT_ERROR
        return fail("no API key exists yet", "create one with `mtplxctl key rotate`")
    if args.json:
        print_json({"key": stored.key, "source": stored.source})
    else:
        console.print(stored.key, markup=False)
        console.print(f"[dim]kept in: {stored.source}[/]")
    return EXIT_OK


def cmd_rotate(args: argparse.Namespace) -> int:
    stored = rotate_key(Paths.from_env())
    restart = _daemon_running()
    if args.json:
        print_json({"key": stored.key, "source": stored.source, "restart_required": restart})
        return EXIT_OK
    console.print(stored.key, markup=False)
    console.print(f"[dim]kept in: {stored.source}[/]")
    if restart:
        console.print("[yellow]the running daemon still uses the old key until `mtplxctl restart`[/]")
    return EXIT_OK


def _daemon_running() -> bool:
    try:
        ControlClient.from_env().call("daemon.status", {})
        return True
    except ControlError:
        return True  # it answered, so it runs
    except DaemonNotRunning:
        return False
