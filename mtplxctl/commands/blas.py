"""blas: which BLAS MLX's CPU backend uses on this machine, and installing the optimized one."""

from __future__ import annotations

import argparse

from mtplxctl.output import EXIT_OK, console, print_json


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `blas` command."""
    blas = subparsers.add_parser(
        "blas", help="check (or --install) the optimized BLAS MLX's CPU backend uses on Linux")
    blas.add_argument("--install", action="store_true",
                      help="install the distribution's OpenBLAS when missing (apt; sudo when not root)")
    blas.add_argument("--json", action="store_true", help="machine-readable output")
    blas.set_defaults(func=cmd_blas)


def cmd_blas(args: argparse.Namespace) -> int:
    """Install when asked, then run the daemon's self-check in a child and print its line.

    Exits 0 even when no optimized BLAS can be had: the daemon then runs on MLX's bundled
    one, and set-up scripts that chain this command must go on.
    """
    from mtplxd import blas

    installed = blas.install() if args.install else None
    found = blas.diagnose()
    if args.json:
        print_json({**found.to_dict(), "summary": found.summary(),
                    "install": None if installed is None else {"ok": installed[0], "message": installed[1]}})
        return EXIT_OK
    if installed is not None:
        console.print(f"blas: {installed[1]}", soft_wrap=True)
    style = "yellow" if found.degraded else "green"
    console.print(f"blas: [{style}]{found.summary()}[/]", soft_wrap=True)
    return EXIT_OK
