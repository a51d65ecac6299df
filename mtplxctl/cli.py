"""The mtplxctl command line: one argparse parser, one module per command group.

Each module in mtplxctl/commands/ exposes `register(subparsers)`, which adds its commands and
sets `func(args) -> exit code` on them.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from mtplxd import POWERED_BY, __version__
from mtplxd.instance import read_pid
from mtplxd.models.hub import ModelStoreError
from mtplxd.paths import HomeUnusable, Paths, unusable_home
from mtplxctl.client import ControlError, DaemonNotAnswering, DaemonNotRunning
from mtplxctl.output import EXIT_ERROR, EXIT_USAGE, fail, not_running

# Command groups, in the order `mtplxctl --help` lists them. A module that is not there yet is
# skipped, so a group can land on its own.
COMMAND_MODULES = [
    "daemon",   # start, stop, restart, status, logs
    "config",   # config get|set
    "models",   # models list|pull|check|update|rm
    "agents",   # agents install|uninstall|status
    "doctor",
    "service",  # service install|uninstall|status
    "fans",     # fans auto|max|smart|status
    "key",      # key show|rotate
    "bench",
    "trace",    # trace [SESSION]
    "tune",     # tune [--depths 0-6]
    "blas",     # blas [--install]
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mtplxctl",
        description="Control the mtplx daemon: a local LLM service for coding agents.",
        epilog=f"{POWERED_BY}. Exit codes: 0 ok, 1 error, 2 usage, 3 daemon not running.",
    )
    parser.add_argument("--version", action="version", version=f"mtplxctl {__version__} — {POWERED_BY}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"mtplxctl.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"mtplxctl.commands.{name}":
                continue
            raise
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(args.func(args) or 0)
    except DaemonNotRunning:
        return not_running(getattr(args, "json", False))
    except DaemonNotAnswering as exc:
        return fail(*not_answering_text(exc, read_pid(Paths.from_env().pid_file)))
    except ControlError as exc:
        # The daemon's messages already say what to do next.
        return fail(exc.message)
    except ModelStoreError as exc:  # the store run in this process (no daemon): same messages
        return fail(exc.message)
    except HomeUnusable as exc:
        return fail(str(exc))
    except OSError as exc:
        # A file under MTPLX_HOME that cannot be written is the home's problem; anything else
        # is still one sentence, never a traceback.
        home = Paths.from_env().home
        if exc.filename and str(exc.filename).startswith(str(home)):
            return fail(str(unusable_home(home, exc)))
        return fail(f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else ""))
    except KeyboardInterrupt:
        return fail("interrupted", code=130)
    except BrokenPipeError:
        return EXIT_ERROR


def not_answering_text(exc: DaemonNotAnswering, pid: int | None) -> tuple[str, str]:
    """(error, what to do) for a daemon that holds its socket but does not answer."""
    who = f"mtplxd (pid {pid})" if pid else "mtplxd"
    error = f"{who} did not answer on {exc.socket_path} within {exc.timeout:g}s"
    if pid is None:
        return error, "see `mtplxctl logs`; if it stays silent, end the process that holds the socket"
    if _is_stopped(pid):
        # A stopped process keeps SIGTERM pending, so only SIGCONT (or SIGKILL) reaches it.
        return (f"{error}; it is stopped (SIGSTOP or Ctrl-Z)",
                f"resume it with `kill -CONT {pid}`, or end it with `kill -9 {pid}` and run "
                "`mtplxctl start`")
    return (f"{error}; it may be hung or very busy",
            f"see `mtplxctl logs`; end it with `kill {pid}` (`kill -9 {pid}` if it stays), then "
            "`mtplxctl start`")


def _is_stopped(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except psutil.Error:
        return False


if __name__ == "__main__":
    sys.exit(main())
