"""start, stop, restart, status, logs: the daemon's lifecycle from the command line."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
from rich.table import Table

from mtplxd.config import Config, ConfigError, env_name, load_config, settings_now
from mtplxd.instance import lock_is_held
from mtplxd.paths import Paths
from mtplxctl.client import ControlClient, DaemonNotRunning
from mtplxctl.output import (key_value_table, EXIT_ERROR, EXIT_OK, console, err_console, fail,
                             human_bytes, human_duration, not_running, print_json, whole_number)

START_TIMEOUT = 60.0
STOP_TIMEOUT = 30.0


def register(subparsers: argparse._SubParsersAction) -> None:
    start = subparsers.add_parser("start", help="start the daemon (if needed) and load the model")
    _add_start_args(start)
    start.set_defaults(func=cmd_start)

    stop = subparsers.add_parser("stop", help="stop the daemon cleanly")
    stop.add_argument("--json", action="store_true", help="machine-readable output")
    stop.set_defaults(func=cmd_stop)

    restart = subparsers.add_parser("restart", help="stop, then start again")
    _add_start_args(restart)
    restart.set_defaults(func=cmd_restart)

    status = subparsers.add_parser("status", help="daemon, model, endpoints and memory")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument("--url", action="store_true",
                        help="print only the API's root URL (for scripts: MTPLX=$(mtplxctl status --url))")
    status.set_defaults(func=cmd_status)

    logs = subparsers.add_parser("logs", help="show the daemon log")
    logs.add_argument("-n", "--lines", type=whole_number(1, 1_000_000), default=50, help="lines to show (default 50)")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    logs.add_argument("--json", action="store_true",
                      help='machine-readable output: {"file": ..., "lines": [...]} (not with -f)')
    logs.set_defaults(func=cmd_logs)


def _add_start_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model to load: a local folder, a pulled repo, or an id")
    parser.add_argument("--host", help="HTTP bind address for this run (default from config)")
    parser.add_argument("--port", type=whole_number(0, 65535), help="HTTP port for this run (default from config)")
    parser.add_argument("--depth", type=whole_number(0, 16), help="MTP depth for this model (0 = plain AR)")
    parser.add_argument("--hosts", help="host file (hosts.json) to serve the model over several "
                        "hosts with MLX distributed (docs/distributed.md)")
    parser.add_argument("--recommended", action="store_true",
                        help="with no model configured, pull and serve the model recommended for "
                             "this machine's memory (`mtplxctl models list --available`)")
    parser.add_argument("--embedding-model", action="append",
                        help="also serve this embedding model at /v1/embeddings (repeatable; for this "
                             "run; `config set embedding_model` keeps it)")
    parser.add_argument("--reranker-model", action="append",
                        help="also serve this reranker at /v1/rerank (repeatable; for this run)")
    parser.add_argument("--retrieval-trust-remote-code", action="store_true",
                        help="serve retrieval checkpoints that ship their own Python code (auto_map)")
    parser.add_argument("--foreground", action="store_true",
                        help="run the daemon in this terminal instead of in the background")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


# ---------------------------------------------------------------- start


def cmd_start(args: argparse.Namespace, checked: bool = False) -> int:
    """`mtplxctl start`; `checked`: restart_blocker has already passed what `args` name (a
    restart keeps an embedding model the stopped daemon ran without, so it is not refused
    here after the stop)."""
    paths = Paths.from_env()
    absolute_model_args(args)
    client = ControlClient(paths.socket)
    was_running = client.is_running()  # before this start: what it launches is not "already running"
    if args.foreground and was_running:
        return fail("mtplxd is already running", "stop it first with `mtplxctl stop`")
    # Before anything starts (or is pulled): the login service could not take the options, or
    # a model named here could not load.
    launches_service = not was_running and not args.foreground
    refused = (_service_refusal(args) if launches_service else None) or (
        None if checked else named_model_blocker(args, paths))
    if refused is not None:
        return fail(*refused)
    if args.foreground:
        os.execv(sys.executable, [sys.executable, "-m", "mtplxd", "--log-stderr", *_daemon_flags(args)])

    if not args.model and not was_running:
        # Nothing named: the catalog's pick when it is pulled (or, with --recommended, pulled
        # now), else the configured or embedded model (docs/models.md).
        from mtplxctl.commands.models import ensure_default_model
        interactive = sys.stdin.isatty() and sys.stderr.isatty() and not args.json
        args.model = ensure_default_model(pull=args.recommended,
                                          confirm=_ask_yes_no if interactive else None)

    if was_running and getattr(args, "hosts", None):
        err_console.print("[yellow]mtplxd is already running; --hosts applies at the next "
                          "`mtplxctl restart --hosts FILE`[/]")
    if not was_running:
        error = _launch(paths, args)
        if error is not None:
            return error
    elif not args.model and _serves_no_model(client):
        # A running daemon left without a model (a failed `start --model X`): a plain start
        # loads the default, as it would on a fresh daemon.
        from mtplxctl.commands.models import ensure_default_model
        _load_model(client, ensure_default_model(pull=args.recommended, confirm=None), args.depth)
        args.depth = None  # loaded with it
    if was_running and (args.host or args.port):
        http = client.call("daemon.status")["http"]
        # --port 0 asks for any free port: whichever the daemon holds is one.
        if (args.host and args.host != http["host"]) or (args.port and args.port != http["port"]):
            err_console.print("[yellow]mtplxd is already running on "
                              f"{http['host']}:{http['port']}; --host/--port apply at the next "
                              "`mtplxctl restart`[/]")
    if was_running:
        _note_retrieval_options(args)

    if args.model or args.depth is not None:
        _load_model(client, args.model, args.depth)
    status = _wait_for_model(client)
    return _report_started(status, args.json)


RETRIEVAL_KEYS = {"embedding_model": "embedding", "reranker_model": "reranker"}


def absolute_model_args(args: argparse.Namespace) -> None:
    """Make the model paths of `start`/`restart` absolute (`~` expanded): the daemon, and
    config.toml at a later start, read them from another working folder."""
    from mtplxd.models.spec import absolute_spec

    if getattr(args, "model", None):
        args.model = absolute_spec(args.model)
    for key in RETRIEVAL_KEYS:
        if getattr(args, key, None):
            setattr(args, key, [absolute_spec(spec) for spec in getattr(args, key)])


def named_model_blocker(args: argparse.Namespace, paths: Paths) -> tuple[str, str | None] | None:
    """(error, what to do) when a model named on the command line cannot load: a `--model`
    path that names no folder, or an embedding or reranker model that resolves to nothing
    (a repo id too: unlike `--model`, those are only resolved when the daemon starts, which
    would then serve without them). None when every one of them can load."""
    from mtplxd.models.spec import missing_folder

    problem = missing_folder(args.model) if args.model else None
    if problem is not None:
        return problem, None
    for key, kind in RETRIEVAL_KEYS.items():
        for spec in getattr(args, key, None) or []:
            failure = _load_failure(spec, paths)
            if failure is not None:
                return f"{kind} model {spec} (--{kind}-model) cannot be loaded: {failure}", None
    return None


def _load_failure(spec: str, paths: Paths) -> Exception | None:
    """What the daemon's load of model `spec` would fail with (resolve_model's
    ModelLoadFailed, the message saying what to do), or None when it resolves."""
    from mtplxd.models.resolve import ModelLoadFailed, resolve_model

    try:
        resolve_model(spec, paths.models_dir)
    except ModelLoadFailed as exc:
        return exc
    return None


def _note_retrieval_options(args: argparse.Namespace) -> None:
    """Say that the embedding and reranker options of `start` wait for the next start: a
    running daemon keeps the ones it was started with."""
    flags = [f"--{kind}-model {spec}" for key, kind in RETRIEVAL_KEYS.items()
             for spec in getattr(args, key, None) or []]
    if getattr(args, "retrieval_trust_remote_code", False):
        flags.append("--retrieval-trust-remote-code")
    if flags:
        err_console.print("[yellow]mtplxd is already running; the embedding and reranker "
                          f"options apply when it starts: `mtplxctl restart {' '.join(flags)}`[/]")


def _serves_no_model(client: ControlClient) -> bool:
    """True when the daemon runs with no model loaded or loading (none, or a failed load)."""
    model = client.call("daemon.status").get("model") or {}
    return model.get("state") not in ("loaded", "loading")


def _ask_yes_no(question: str) -> bool:
    from rich.prompt import Confirm

    return Confirm.ask(question, default=False, console=err_console)


def _daemon_flags(args: argparse.Namespace) -> list[str]:
    flags: list[str] = []
    if args.host:
        flags += ["--host", args.host]
    if args.port is not None:
        flags += ["--port", str(args.port)]
    if getattr(args, "hosts", None):
        flags += ["--hosts", str(Path(args.hosts).expanduser().resolve())]
    embedders, rerankers, trust = _retrieval_options(args)
    for spec in embedders:
        flags += ["--embedding-model", spec]
    for spec in rerankers:
        flags += ["--reranker-model", spec]
    if trust:
        flags.append("--retrieval-trust-remote-code")
    if args.model or args.depth is not None:
        # mtplxctl loads it over the socket, with progress, once the daemon answers.
        flags.append("--no-model")
    return flags


def _retrieval_options(args: argparse.Namespace) -> tuple[list[str], list[str], bool]:
    """(embedding models, rerankers, trust remote code) of `start`/`restart`; commands that
    start the daemon without those options (restart paths, tests) have none."""
    return (list(getattr(args, "embedding_model", None) or []),
            list(getattr(args, "reranker_model", None) or []),
            bool(getattr(args, "retrieval_trust_remote_code", None)))


# The options of `start`/`restart` that set up the daemon process itself: a daemon started by
# the login service runs from the saved configuration, under these same names as config keys.
START_ONLY_OPTIONS = ("host", "port", "hosts", "embedding_model", "reranker_model",
                      "retrieval_trust_remote_code")


def _start_only_options(args: argparse.Namespace) -> list[str]:
    """The start-only options the user passed (as config keys), in START_ONLY_OPTIONS order."""
    # argparse leaves an unused option None (a flag False); `--port 0` is a choice, so no
    # truthiness test. Callers without these options (restart paths) have none.
    return [key for key in START_ONLY_OPTIONS
            if getattr(args, key, None) is not None and getattr(args, key, None) is not False]


def _launch(paths: Paths, args: argparse.Namespace) -> int | None:
    """Start the daemon: through the service manager when installed, else detached."""
    manager = _installed_service_manager()
    if manager is not None:  # cmd_start has refused the options it cannot take
        error = _start_service(manager)
        if error is not None:
            return error
        process = None
    else:
        paths.ensure()
        # 0600 like every log: it names models, paths and clients.
        out = os.fdopen(os.open(paths.logs_dir / "mtplxd.out", os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                                0o600), "ab")
        os.fchmod(out.fileno(), 0o600)
        process = subprocess.Popen(
            [sys.executable, "-m", "mtplxd", *_daemon_flags(args)],
            stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True, close_fds=True)
        out.close()
    return _wait_until_up(paths, process)


def _service_refusal(args: argparse.Namespace) -> tuple[str, str] | None:
    """(error, what to do) when the installed login service would start mtplxd and `args`
    hold start-only options it cannot pass; None otherwise."""
    refused = _start_only_options(args)
    if not refused or _installed_service_manager() is None:
        return None
    flags = ", ".join("--" + key.replace("_", "-") for key in refused)
    saves = "; ".join(f"`mtplxctl config set {key} VALUE`" for key in refused)
    return (f"the login service runs mtplxd with the saved configuration, so it cannot take {flags}",
            f"save them instead ({saves}), then `mtplxctl restart`")


def _installed_service_manager() -> Any:
    try:
        from mtplxctl.launchd import service_manager
    except ImportError:
        return None
    manager = service_manager()
    return manager if manager is not None and manager.is_installed() else None


def _start_service(manager: Any) -> int | None:
    """Start the installed login service; an exit code when launchctl/systemctl refused."""
    from mtplxctl.launchd import ServiceError

    try:
        manager.start()
    except ServiceError as exc:
        return fail(f"the login service could not start mtplxd: {exc}",
                    exc.hint or "see `mtplxctl service status`")
    return None


def _wait_until_up(paths: Paths, process: subprocess.Popen | None) -> int | None:
    client = ControlClient(paths.socket)
    deadline = time.monotonic() + START_TIMEOUT
    with console.status("starting mtplxd…", spinner="dots"):
        while time.monotonic() < deadline:
            if client.is_running():
                return None
            if process is not None and process.poll() is not None:
                last = _last_output(paths)
                if last.startswith("mtplxd: "):
                    # The daemon's own one-sentence reason, which already says what to do.
                    return fail(last.removeprefix("mtplxd: "))
                return fail(f"mtplxd exited at start (code {process.returncode}): {last}",
                            "see `mtplxctl logs`")
            time.sleep(0.1)
    return fail(f"mtplxd did not answer on {paths.socket} within {START_TIMEOUT:.0f}s",
                "see `mtplxctl logs`")


def _last_output(paths: Paths) -> str:
    try:
        lines = (paths.logs_dir / "mtplxd.out").read_text(errors="replace").strip().splitlines()
    except FileNotFoundError:
        return "no output"
    return lines[-1] if lines else "no output"


def _load_model(client: ControlClient, model: str | None, depth: int | None) -> None:
    params: dict[str, Any] = {}
    if model:
        params["model"] = model
    if depth is not None:
        params["depth"] = depth
    with console.status(f"loading {model or 'the configured model'}…", spinner="dots"):
        client.call("model.load", params, timeout=None)


def _wait_for_model(client: ControlClient) -> dict[str, Any]:
    """Wait while the daemon is still loading its model at start; return the final status."""
    status = client.call("daemon.status")
    if (status.get("model") or {}).get("state") == "loading":
        with console.status("loading model…", spinner="dots"):
            while (status.get("model") or {}).get("state") == "loading":
                time.sleep(0.2)
                status = client.call("daemon.status")
    return status


def _report_started(status: dict[str, Any], as_json: bool) -> int:
    model = status.get("model")
    if as_json:
        print_json(status)
    else:
        console.print(f"mtplxd running (pid {status['pid']}) — API [bold]{status['http']['base_url']}[/]")
        if model and model.get("state") == "loaded":
            console.print(f"model [bold]{model['id']}[/] — {_mode_text(model)}")  # as status shows it
            if model.get("hint"):
                console.print(f"[dim]{model['hint']}[/]")
        elif model and model.get("state") == "failed":
            err_console.print(f"[red]model failed to load:[/] {model.get('error')}")
        else:
            console.print("no model loaded — load one with `mtplxctl start --model PATH_OR_REPO`")
    if model and model.get("state") == "failed":
        return EXIT_ERROR
    return EXIT_OK


def _context_text(model: dict[str, Any]) -> str:
    """The served window, and the model's own when memory is what caps it."""
    text = f"{model.get('context_length')} tokens"
    if model.get("context_limited_by") == "memory":
        text += (f" (capped by the memory limit; the model's is {model.get('model_context_length')}"
                 " — `mtplxctl config set memory_limit max` raises it)")
    return text


def _kernels_text(kernels: dict[str, str]) -> str:
    """Which implementation each fast path runs (quantized matmul, cache attention, GDN verify)."""
    return "; ".join(f"{name.replace('_', ' ')}: {path}" for name, path in kernels.items())


def _mode_text(model: dict[str, Any]) -> str:
    return _decoding_text(model) + _images_text(model)


def _decoding_text(model: dict[str, Any]) -> str:
    if model.get("mode") == "mtp":
        loop = " (fused loop)" if model.get("decode_loop") == "fused" else ""
        weights = model.get("quantization") or model.get("dtype")
        reason = f" ({model['depth_reason']})" if model.get("depth_reason") else ""
        return f"MTP depth {model.get('depth')}{reason}{loop}" + (f", {weights}" if weights else "")
    return f"AR: {model.get('ar_reason') or 'no MTP head'}"


def _images_text(model: dict[str, Any]) -> str:
    """Whether the prompt may carry images, and why not when the checkpoint has a tower."""
    if model.get("vision"):
        return "; reads images"
    if model.get("vision_reason"):
        return f"; text only: {model['vision_reason']}"
    return ""


# ---------------------------------------------------------------- stop / restart


def cmd_stop(args: argparse.Namespace) -> int:
    paths = Paths.from_env()
    client = ControlClient(paths.socket)
    if not client.is_running():
        return not_running(args.json)
    pid, stopped = _stop_daemon(paths, client)
    if args.json:
        print_json({"stopped": stopped, "pid": pid})
    elif stopped:
        console.print(f"mtplxd stopped (pid {pid})")
    if not stopped:
        return fail(f"mtplxd (pid {pid}) did not stop within {STOP_TIMEOUT:.0f}s",
                    f"check `mtplxctl logs`; `kill {pid}` sends SIGTERM")
    return EXIT_OK


def _stop_daemon(paths: Paths, client: ControlClient) -> tuple[int, bool]:
    """Ask the running daemon to stop; return (its pid, whether it stopped in time)."""
    status = client.call("daemon.status")
    pid = status["pid"]
    manager = _installed_service_manager()
    # A daemon started by hand while the service is installed is not the service's to stop.
    if manager is None or status.get("supervisor") != manager.name or not _stop_service(manager):
        # A clean exit 0 is not a crash either: KeepAlive {SuccessfulExit: false} and
        # Restart=on-failure leave a daemon stopped this way down too.
        try:
            client.call("daemon.shutdown")
        except DaemonNotRunning:
            pass
    return pid, _wait_stopped(paths, pid)


def _stop_service(manager: Any) -> bool:
    """bootout / systemctl stop: SIGTERM, not counted as a crash, so the service stays down.

    False (with a warning) when the service manager refused; the caller then stops the daemon
    over the socket.
    """
    from mtplxctl.launchd import ServiceError

    try:
        manager.stop()
    except ServiceError as exc:
        err_console.print(f"[yellow]the login service could not stop mtplxd ({exc}); "
                          "asking the daemon directly[/]")
        return False
    return True


def _wait_stopped(paths: Paths, pid: int) -> bool:
    deadline = time.monotonic() + STOP_TIMEOUT
    with console.status("stopping mtplxd…", spinner="dots"):
        while time.monotonic() < deadline:
            if not lock_is_held(paths.lock_file) and not _pid_alive(pid):
                return True
            time.sleep(0.1)
    return False


def _pid_alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (exited, not yet reaped by its parent) counts as gone."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def cmd_restart(args: argparse.Namespace) -> int:
    paths = Paths.from_env()
    client = ControlClient(paths.socket)
    absolute_model_args(args)
    if client.is_running():
        status = client.call("daemon.status")
        carried = carry_running_options(status, args, paths)
        # Stopping first would leave nothing running when the next daemon cannot start.
        blocker = restart_blocker(paths, args, carried)
        if blocker is not None:
            error, hint = blocker
            return fail(f"cannot restart: {error}",
                        f"{hint}; mtplxd (pid {status['pid']}) is still running, nothing was stopped")
        pid, stopped = _stop_daemon(paths, client)
        if not stopped:
            return fail(f"mtplxd (pid {pid}) did not stop within {STOP_TIMEOUT:.0f}s",
                        "check `mtplxctl logs`")
        if carried and not args.json:
            err_console.print(f"restarting as it ran: {' '.join(carried)} (give an option to "
                              "change it)")
        return cmd_start(args, checked=True)
    return cmd_start(args)


def restart_blocker(paths: Paths, args: argparse.Namespace,
                    carried: list[str] | tuple[str, ...] = ()) -> tuple[str, str] | None:
    """What would keep the next daemon from starting (or from loading its model or its
    embedding and reranker models) as `args` ask, checked while the running one still serves:
    (error, what to do), or None.

    `carried`: the options `args` hold from the running daemon (carry_running_options), not
    given to restart.
    """
    model_carried = any(flag.startswith("--model ") for flag in carried)
    refused = _service_refusal(args)
    if refused is not None:
        return refused
    try:
        config = _next_config(paths, args)
    except ConfigError as exc:
        return (f"configuration error: {exc}",
                f"fix {paths.config_file} (`mtplxctl config set KEY VALUE` writes valid values)")
    if args.model:
        source = "the model it runs now" if model_carried else "given with --model"
    else:
        source = "the `model` of config.toml"
    return (_listen_blocker(config, paths)
            or _model_blocker(args.model or config.model, source, paths)
            or _retrieval_blocker(config, paths, carried))


def _next_config(paths: Paths, args: argparse.Namespace) -> Config:
    """The settings the next daemon would run with: config.toml, the environment, and the
    start-only options of `args` (as the daemon applies its flags). Raises ConfigError."""
    config = load_config(paths.config_file)
    for key in _start_only_options(args):
        config.override(key, getattr(args, key))
    return config


def _listen_blocker(config: Config, paths: Paths) -> tuple[str, str] | None:
    """Why the next daemon could not listen on `config.host`, or None."""
    import socket

    from mtplxd.api.address import is_loopback
    from mtplxd.api.auth import load_key

    use_local = "restart with `--host 127.0.0.1` or an address of this machine"
    if not is_loopback(config.host) and load_key(paths) is None:
        return (f"mtplxd does not listen on {config.host} without an API key",
                f"create one with `mtplxctl key rotate` (or set MTPLX_API_KEY), or {use_local}")
    try:  # any port: the running daemon still holds the one it will use
        family, kind, proto, _, address = socket.getaddrinfo(
            config.host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.bind(address)
    except OSError as exc:
        return f"mtplxd could not listen on {config.host}: {exc.strerror or exc}", use_local
    return None


def _model_blocker(spec: str | None, source: str, paths: Paths) -> tuple[str, str] | None:
    """Why the next daemon could not find model `spec` ("" or None: the default), or None."""
    from mtplxd.models.hub import ModelStoreError
    from mtplxd.models.spec import looks_like_path

    failure = _load_failure(spec, paths) if spec else None  # no spec: the embedded model
    if failure is None:
        return None
    # A damaged manifest's message and a missing folder's say what to do themselves.
    said = isinstance(failure.__cause__, ModelStoreError) or looks_like_path(spec)
    why = str(failure) if said else "it is neither a local folder nor a pulled model"
    other = "restart with another model (`mtplxctl restart --model PATH_OR_REPO`)"
    if looks_like_path(spec):  # a folder that is gone: nothing to pull
        return f"model {spec} ({source}) cannot be loaded: {why}", other
    return (f"model {spec} ({source}) cannot be loaded: {why}",
            f"{other}, or pull it (`mtplxctl models pull {spec}`)")


def _retrieval_blocker(config: Config, paths: Paths,
                       carried: list[str] | tuple[str, ...]) -> tuple[str, str] | None:
    """Why an embedding or reranker model the next daemon would serve cannot load, or None.

    The ones carried from the running daemon are left out: it already runs without them (its
    log says why), and a restart keeps what it runs."""
    for key, kind in RETRIEVAL_KEYS.items():
        flag = f"--{kind}-model"
        if config.sources[key] == "cli" and any(f.startswith(flag + " ") for f in carried):
            continue
        for spec in config.values[key]:
            failure = _load_failure(spec, paths)
            if failure is None:
                continue
            if config.sources[key] == "cli":
                return (f"{kind} model {spec} (given with {flag}) cannot be loaded: {failure}",
                        f"restart with another ({flag} PATH_OR_REPO)")
            if config.sources[key] == "env":
                return (f"{kind} model {spec} ({env_name(key)}) cannot be loaded: {failure}",
                        f"change or unset {env_name(key)}")
            return (f"{kind} model {spec} (the `{key}` of config.toml) cannot be loaded: "
                    f"{failure}", f"change it with `mtplxctl config set {key} VALUE` (an empty "
                    "VALUE removes it)")
    return None


def carry_running_options(status: dict[str, Any], args: argparse.Namespace,
                          paths: Paths) -> list[str]:
    """Set on `args` what the running daemon was started with (its start-only options, the
    model and depth it was asked to load) where `restart` was not given them, unless
    config.toml has changed that key since (then the file wins, as `config set` promised).
    Returns the options carried, as flags (for the message)."""
    in_file = settings_now(paths.config_file)
    wanted: dict[str, Any] = {}
    for key, launched in (status.get("launch_options") or {}).items():
        if key in START_ONLY_OPTIONS and in_file.get(key) == launched.get("config_value"):
            wanted[key] = launched.get("value")
    loaded = (status.get("model") or {}).get("loaded_as") or {}
    if loaded.get("spec") and in_file.get("model") == loaded.get("config_model"):
        wanted["model"] = loaded["spec"]
    if loaded.get("depth") is not None and in_file.get("depth") == loaded.get("config_depth"):
        wanted["depth"] = loaded["depth"]
    carried = []
    for key, value in wanted.items():
        if getattr(args, key, None) not in (None, False, []) or value in (None, False, []):
            continue  # given to restart, or nothing to carry
        setattr(args, key, value)
        flag = "--" + key.replace("_", "-")
        values = value if isinstance(value, list) else [value]
        carried += [flag] if value is True else [f"{flag} {v}" for v in values]
    return carried


# ---------------------------------------------------------------- status


def cmd_status(args: argparse.Namespace) -> int:
    paths = Paths.from_env()
    try:
        status = ControlClient(paths.socket).call("daemon.status")
    except DaemonNotRunning:
        return not_running(args.json)
    if args.json:
        print_json({"running": True, **status})
        return EXIT_OK
    if args.url:
        print(status["http"]["url"])
        return EXIT_OK
    console.print(status_table(status))
    return EXIT_OK


def status_table(status: dict[str, Any]) -> Table:
    """The human view of `daemon.status`."""
    table = key_value_table()
    table.add_row("daemon", f"running, pid {status['pid']}, up {human_duration(status['uptime_seconds'])}"
                  f" (mtplxd {status['version']})")
    table.add_row("supervisor", status.get("supervisor") or "none (started by hand)")
    socket_text = status["socket"] + (" (short fallback path)" if status.get("socket_fallback") else "")
    table.add_row("socket", socket_text)
    http = status["http"]
    table.add_row("API", http["base_url"] + ("  (API key required)" if http.get("key_required") else ""))
    model = status.get("model")
    if not model:
        table.add_row("model", "none loaded — `mtplxctl start --model PATH_OR_REPO`")
    elif model.get("state") == "loaded":
        table.add_row("model", f"{model['id']} — {_mode_text(model)}")
        table.add_row("context", _context_text(model))
        if model.get("kernels"):
            table.add_row("kernels", _kernels_text(model["kernels"]))
        if model.get("demo"):
            table.add_row("note", model.get("hint", ""))
    else:
        table.add_row("model", f"{model.get('state')}: {model.get('error') or ''}")
    memory = status.get("memory", {})
    # The weights as held (a dequantized or upcast model holds more than its files).
    weights = (f" (model weights {human_bytes(model['weights_bytes'])})"
               if model and model.get("state") == "loaded" and model.get("weights_bytes") else "")
    table.add_row("memory", f"daemon {human_bytes(memory.get('rss_bytes'))}{weights}, system "
                  f"{human_bytes(memory.get('system_available_bytes'))} free of "
                  f"{human_bytes(memory.get('system_total_bytes'))}")
    table.add_row("requests", f"{status.get('requests', {}).get('active', 0)} in flight")
    if status.get("blas"):
        level = "[yellow]" if status["blas"].get("degraded") else ""
        table.add_row("BLAS", f"{level}{status['blas']['summary']}{'[/]' if level else ''}")
    scheduler = status.get("scheduler")
    if scheduler:
        table.add_row("scheduler", f"{scheduler['running']} running of {scheduler['max_concurrent']}"
                      f" rows, {scheduler['queued']} queued (max {scheduler['max_queued']})")
        if scheduler.get("cohort_widths"):
            table.add_row("cohorts", f"widths {','.join(map(str, scheduler['cohort_widths']))}, "
                          f"numerics {scheduler.get('numerics')}, {scheduler.get('paused', 0)} paused")
        for row in scheduler.get("rows", []):
            width = f", cohort {row['cohort_width']} wide" if row.get("cohort_width") else ""
            table.add_row("", f"{row.get('request_id') or row['row']}: {row['phase']}, "
                          f"{row['completion_tokens']} tokens, waited {row['queue_wait_seconds']}s{width}")
    guard = status.get("guard")
    if guard:
        table.add_row("memory guard", f"limit {human_bytes(guard['limit_bytes'])}, "
                      f"{human_bytes(guard['available_bytes'])} available, fits "
                      f"{guard['max_context_tokens']} tokens per request, {guard['refused']} refused")
    bank = status.get("session_bank")
    if bank:
        if bank.get("enabled") is False:
            table.add_row("session bank", "off (`mtplxctl config set session_bank_bytes auto`)")
        else:
            table.add_row("session bank", f"{bank['entries']} entries, {human_bytes(bank['bytes'])} of "
                          f"{human_bytes(bank['cap_bytes'])}, hit rate {bank['hit_rate']:.0%}; disk "
                          f"{bank.get('ssd_entries', 0)} entries, {human_bytes(bank.get('ssd_bytes', 0))}")
        if bank.get("note"):
            table.add_row("", f"[yellow]{bank['note']}[/]")
    for line in group_lines(status.get("group")):
        table.add_row(*line)
    if status.get("fans"):
        from mtplxctl.commands.fans import summary_line

        table.add_row("fans", summary_line(status["fans"]))
    table.add_row("", f"[dim]{status['powered_by']}[/]")
    return table


def group_lines(group: dict[str, Any] | None) -> list[tuple[str, str]]:
    """Status rows of a distributed group: one per rank, the link, what was lost."""
    if not group:
        return []
    parallel = group.get("parallel") or "pipeline"
    lines = [("group", f"{group['size']} ranks ({parallel} parallel) from {group['hosts_file']}")]
    share = "a part of layers" if parallel == "tensor" else "layers"
    for rank in group.get("ranks", []):
        first, end = rank["layers"]
        state = "" if rank.get("running", True) else f" [red]exited ({rank.get('exit_code')})[/]"
        lines.append(("", f"rank {rank['rank']} {rank['host']}: {share} {first}-{end - 1}, "
                          f"{human_bytes(rank['weights_bytes'])} weights of "
                          f"{human_bytes(rank['memory_bytes'])}{state}"))
    link = group.get("link")
    if link:
        bandwidth = link.get("hop_bandwidth_mb_s")
        lines.append(("", f"link: {link['hop_latency_ms']} ms a hop, "
                          f"{bandwidth if bandwidth else '?'} MB/s (measured at start)"))
    if group.get("lost"):
        lines.append(("", f"[red]lost: {group['lost']}[/] — `mtplxctl restart`"))
    return lines


# ---------------------------------------------------------------- logs


def cmd_logs(args: argparse.Namespace) -> int:
    log_file = Paths.from_env().log_file
    if not log_file.exists():
        return fail(f"no log yet at {log_file}", "start the daemon with `mtplxctl start`")
    if args.json:
        from mtplxd.logs import tail

        print_json({"file": str(log_file), "lines": list(tail(log_file, args.lines))})
        return EXIT_OK
    _print_tail(log_file, args.lines)
    if args.follow:
        try:
            _follow(log_file)
        except KeyboardInterrupt:
            pass
    return EXIT_OK


def _print_tail(log_file: Path, lines: int) -> None:
    from mtplxd.logs import tail

    for line in tail(log_file, lines):
        sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _follow(log_file: Path) -> None:
    """Print lines as they are appended, across rotation (the file is reopened when replaced)."""
    handle = open(log_file, "r", encoding="utf-8", errors="replace")
    handle.seek(0, os.SEEK_END)
    inode = os.fstat(handle.fileno()).st_ino
    while True:
        line = handle.readline()
        if line:
            sys.stdout.write(line)
            sys.stdout.flush()
            continue
        time.sleep(0.2)
        try:
            if os.stat(log_file).st_ino != inode:
                handle.close()
                handle = open(log_file, "r", encoding="utf-8", errors="replace")
                inode = os.fstat(handle.fileno()).st_ino
        except FileNotFoundError:
            pass
