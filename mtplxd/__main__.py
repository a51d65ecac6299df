"""`mtplxd` / `python -m mtplxd`: parse arguments and run the daemon in the foreground."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import sys

import trio

from mtplxd import POWERED_BY, __version__, blas, fd_limits
from mtplxd.api.address import is_loopback, port_owner
from mtplxd.api.auth import load_key
from mtplxd.config import ConfigError, load_config
from mtplxd.daemon import Daemon
from mtplxd.instance import AlreadyRunning, InstanceLock
from mtplxd.logs import setup_logging
from mtplxd.paths import HomeUnusable, Paths

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_CONFIG = 2
EXIT_PORT_IN_USE = 4


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mtplxd", description=f"The mtplx daemon. {POWERED_BY}.",
        epilog="Usually started by `mtplxctl start` or the login service, not by hand.")
    parser.add_argument("--version", action="version", version=f"mtplxd {__version__} — {POWERED_BY}")
    parser.add_argument("--host", help="HTTP bind address (config key host)")
    parser.add_argument("--port", type=int, help="HTTP port (config key port; 0 picks a free one)")
    parser.add_argument("--model", help="model to load at start (config key model)")
    parser.add_argument("--depth", type=int, help="default MTP depth (config key depth)")
    parser.add_argument("--hosts", help="host file of a distributed group (config key hosts)")
    parser.add_argument("--no-model", action="store_true", help="start without loading a model")
    parser.add_argument("--embedding-model", action="append",
                        help="serve this embedding model at /v1/embeddings (repeatable; config key "
                             "embedding_model)")
    parser.add_argument("--reranker-model", action="append",
                        help="serve this reranker at /v1/rerank (repeatable; config key reranker_model)")
    parser.add_argument("--retrieval-trust-remote-code", action="store_true", default=None,
                        help="serve retrieval checkpoints that ship Python code (auto_map)")
    parser.add_argument("--log-stderr", action="store_true", help="also log to stderr")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    fd_limits.raise_soft_limit()  # every connection is a descriptor: as many as the machine allows
    paths = Paths.from_env()
    try:
        config = load_config(paths.config_file)
        in_file = dict(config.values)
        for key in ("host", "port", "model", "depth", "hosts", "embedding_model", "reranker_model",
                    "retrieval_trust_remote_code"):
            if getattr(args, key) is not None:
                config.override(key, getattr(args, key))
        # What this process was started with beside config.toml (and the file's value then):
        # `mtplxctl restart` starts the next one the same way (daemon.status: launch_options).
        launch_options = {key: {"value": config.values[key], "config_value": in_file.get(key)}
                          for key, source in config.sources.items() if source == "cli"}
    except ConfigError as exc:
        print(f"mtplxd: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if not is_loopback(config.host) and load_key(paths) is None:
        # Anyone on the network could drive the model: never listen there without a key.
        print(f"mtplxd: refusing to listen on {config.host} without an API key; create one with "
              "`mtplxctl key rotate` (or set MTPLX_API_KEY), or bind to 127.0.0.1", file=sys.stderr)
        return EXIT_CONFIG
    try:
        paths.ensure()
    except HomeUnusable as exc:
        print(f"mtplxd: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    lock = InstanceLock(paths.lock_file, paths.pid_file)
    try:
        lock.acquire()
    except AlreadyRunning as exc:
        print(f"mtplxd: {exc}; stop it with `mtplxctl stop`", file=sys.stderr)
        return EXIT_ERROR
    daemon = None
    try:
        setup_logging(paths.log_file, config.log_level, to_stderr=args.log_stderr)
        _log_blas()
        daemon = Daemon(config, paths, load_model=not args.no_model,
                        launch_options=launch_options)
        trio.run(daemon.run)
    except (OSError, ExceptionGroup) as exc:
        # trio hands a bind failure over inside (nested) exception groups.
        error = _first_os_error(exc)
        if error is None:
            raise
        if daemon is not None and daemon.ready:
            # It served, then failed: say so, with the traceback in the log.
            logging.getLogger("mtplxd").error("mtplxd stopped by an error", exc_info=exc)
            print(f"mtplxd: stopped by an error after it had started: {error.strerror or error} "
                  f"(the traceback is in {paths.log_file})", file=sys.stderr)
            return EXIT_ERROR
        print(f"mtplxd: {_start_error_text(error, config)}", file=sys.stderr)
        return EXIT_PORT_IN_USE if error.errno == errno.EADDRINUSE else EXIT_ERROR
    finally:
        lock.release()
    return EXIT_OK


def _log_blas() -> None:
    """One line in the log on which BLAS MLX runs (chosen when the engine was imported)."""
    chosen = blas.activate()
    if chosen.degraded:
        logging.getLogger("mtplxd").warning("blas: %s", chosen.summary())
    else:
        logging.getLogger("mtplxd").info("blas: %s", chosen.summary())


def _first_os_error(exc: BaseException) -> OSError | None:
    """The OSError inside `exc`, looking through exception groups."""
    if isinstance(exc, OSError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _first_os_error(inner)
            if found is not None:
                return found
    return None


def _start_error_text(error: OSError, config) -> str:
    """One sentence for an OS error at start: who holds the port, which address cannot be
    bound, and what to do."""
    import socket

    where = f"{config.host}:{config.port}"
    use_local = ("use 127.0.0.1 or an address of this machine (`mtplxctl start --host "
                 "127.0.0.1`, or `mtplxctl config set host 127.0.0.1`)")
    if isinstance(error, socket.gaierror):
        return (f"cannot listen on {where}: the host {config.host!r} does not resolve "
                f"({error.strerror or error}); {use_local}")
    if error.errno == errno.EADDRNOTAVAIL:
        return (f"cannot listen on {where}: {config.host} is not an address of this machine "
                f"({error.strerror}); {use_local}")
    if error.errno != errno.EADDRINUSE:
        return f"cannot start: {error.strerror or error}"
    owner = port_owner(config.port)
    held = f" by PID {owner[0]} ({owner[1]})" if owner else " by another program"
    return (f"port {config.port} is in use{held}; stop that program, or pick another port with "
            f"`mtplxctl start --port {config.port + 1}` (or `mtplxctl config set port "
            f"{config.port + 1}`)")


def entry() -> None:
    """Console entry point: run the daemon, then leave without interpreter teardown.

    Everything the daemon owns (socket, pid file, lock, fans, logs) is released by main(). Skipping
    finalization avoids tearing down MLX's native threads and globals in an arbitrary order at
    exit, which was seen to abort ("terminate called without an active exception").
    """
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
