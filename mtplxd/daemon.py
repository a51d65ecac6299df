"""The daemon: one trio process whose nursery owns every service.

Order at start: take the single-instance lock (before binding anything), set up logging, bind
the control socket, serve HTTP, report ready, then load the configured model in the
background. SIGTERM/SIGINT (what launchd and systemd send) drain in-flight requests for
`shutdown_grace_seconds`, then every service is cancelled and cleans up after itself.
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Any

import hypercorn.config
import hypercorn.trio
import trio

from mtplxd import __version__
from mtplxd.api.address import http_status
from mtplxd.api.app import create_app
from mtplxd.config import Config
from mtplxd.control.methods import register_daemon_methods
from mtplxd.control.registry import MethodRegistry
from mtplxd.control.server import serve_control
from mtplxd.fans.controller import build_controller
from mtplxd.fans.methods import register_fan_methods
from mtplxd.flight import FlightRecorder
from mtplxd.models.methods import register_model_store_methods
from mtplxd.paths import Paths
from mtplxd.pressure import CHECK_INTERVAL_SECONDS, memory_pressure, watch_pressure
from mtplxd.models.resolve import ModelLoadFailed
from mtplxd.runtime import BankOptions, Runtime
from mtplxd.supervisor import detect_supervisor, sd_notify

log = logging.getLogger(__name__)

# At shutdown, once no generation runs: how long the HTTP server gets to write its last frames.
HTTP_DRAIN_SECONDS = 2.0


def serving_group(config: Config, paths: Paths) -> Any:
    """The distributed group the `hosts` setting asks for (docs/distributed.md)."""
    from pathlib import Path

    from mtplxd.engine.distributed.serving import GroupOptions, ServingGroup

    options = GroupOptions(Path(config.hosts).expanduser(), paths.logs_dir / "group",
                           config.pipeline_split, float(config.group_timeout_seconds),
                           config.group_port)
    return ServingGroup(options, log=log.info)


class Daemon:
    """The running daemon's state, shared by the control methods and the HTTP app."""

    def __init__(self, config: Config, paths: Paths, load_model: bool = True,
                 launch_options: dict[str, dict[str, Any]] | None = None) -> None:
        self.config = config
        self.paths = paths
        # The start options given beside config.toml ({key: {"value", "config_value"}}).
        self.launch_options = launch_options or {}
        self.loaded_as: dict[str, Any] | None = None  # the last model.load's ask (control methods)
        self.load_model_at_start = load_model
        self.started_at = time.time()
        self.supervisor = detect_supervisor()
        depth = None if config.depth == "auto" else config.depth  # None: the model's own
        self.runtime = Runtime(paths.models_dir, depth, bank=BankOptions(ssd_dir=paths.session_bank_dir),
                               max_concurrent=config.max_concurrent, max_queued=config.max_queued,
                               prefill_chunk_tokens=config.prefill_chunk_tokens,
                               cohorts=config.cohorts, cohort_widths=tuple(config.cohort_widths),
                               numerics=config.numerics, cohort_cycle=config.cohort_cycle,
                               tuning_home=paths.home)
        self.runtime.use_load_settings(config)
        if config.hosts:
            self.runtime.group = serving_group(config, paths)
        specs = ([(m, "embedding") for m in config.embedding_model]
                 + [(m, "rerank") for m in config.reranker_model])
        for problem in self.runtime.configure_retrieval(specs, config.retrieval_resident_limit,
                                                        config.retrieval_trust_remote_code):
            log.warning("not serving %s", problem)
        self.registry = MethodRegistry()
        self.http_binds: list[str] = []
        self.ready = False  # True once it serves: a failure after that is no failure to start
        self._shutdown = trio.Event()
        register_daemon_methods(self.registry, self)
        register_model_store_methods(self.registry, self.paths)
        self.fans = build_controller(config, paths)
        register_fan_methods(self.registry, self.fans)
        self.runtime.activity.append(self.fans.on_activity)
        self.recorder = FlightRecorder(paths.metrics_dir, config.flight_recorder_mb * 1_000_000,
                                       enabled=config.flight_recorder)

    def request_shutdown(self, why: str) -> None:
        if not self._shutdown.is_set():
            log.info("shutdown requested (%s)", why)
            self._shutdown.set()

    def http_status(self) -> dict[str, Any]:
        """The HTTP endpoint as `daemon.status` reports it (see `api.address.http_status`)."""
        return http_status(self.config.host, self.config.port, self.http_binds)

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until shutdown is requested, then drain and stop every service."""
        self.runtime.start()
        self.recorder.start()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_signals)
                # Before binding anything: restore a lease a dead daemon left, apply fan_mode.
                # Its task restores the fans when the nursery is cancelled at shutdown.
                await nursery.start(self.fans.run)
                # HTTP binds before the control socket: whoever sees the daemon answer (mtplxctl
                # start, the service manager) can rely on the API being up and its port known.
                http_done = trio.Event()
                self.http_binds = await nursery.start(self._serve_http, http_done)
                await nursery.start(serve_control, self.paths.socket, self.registry)
                log.info("mtplxd %s ready: control %s, http %s", __version__, self.paths.socket,
                         ", ".join(self.http_binds))
                sd_notify("READY=1")
                self.ready = True
                task_status.started()
                if self.load_model_at_start:
                    nursery.start_soon(self._load_initial_model)
                nursery.start_soon(watch_pressure, self._bank_bytes, self._release_bank)
                # Embedding and reranker models are dropped under pressure too (they reload).
                nursery.start_soon(watch_pressure, lambda: len(self.runtime.retrieval.resident()),
                                   self._release_retrieval, memory_pressure, CHECK_INTERVAL_SECONDS,
                                   "resident retrieval models")
                await self._shutdown.wait()
                sd_notify("STOPPING=1")
                with trio.move_on_after(self.config.shutdown_grace_seconds):
                    await self.runtime.wait_idle()
                # The engine is done; the last frames still have to reach the clients. Hypercorn
                # would also wait out its grace for idle keep-alive connections (agents' pools),
                # which it never closes here: the frames get HTTP_DRAIN_SECONDS, then it stops.
                with trio.move_on_after(HTTP_DRAIN_SECONDS):
                    await http_done.wait()
                nursery.cancel_scope.cancel()
        finally:
            self.runtime.stop()
            self.recorder.stop()
            log.info("mtplxd stopped")

    async def _serve_http(self, done: trio.Event,
                          task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve the HTTP API until shutdown is requested and its responses are finished."""
        try:
            await hypercorn.trio.serve(create_app(self.runtime, self.config,
                                                  recorder=self.recorder), self._hypercorn_config(),
                                       shutdown_trigger=self._shutdown.wait, task_status=task_status)
        finally:
            done.set()

    def _hypercorn_config(self) -> hypercorn.config.Config:
        config = hypercorn.config.Config()
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        config.bind = [f"{host}:{self.config.port}"]
        config.graceful_timeout = float(self.config.shutdown_grace_seconds)
        config.accesslog = None
        config.errorlog = logging.getLogger("hypercorn.error")
        config.server_names = []
        return config

    def _release_retrieval(self, needed: int) -> int:
        count = len(self.runtime.retrieval.resident())
        self.runtime.release_retrieval()
        return count

    def _bank_bytes(self) -> int:
        guard = self.runtime.guard
        return guard.holders()["session_bank"] if guard is not None else 0

    def _release_bank(self, needed: int) -> int:
        guard = self.runtime.guard
        return guard.release_bank(needed) if guard is not None else 0

    async def _watch_signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                self.request_shutdown(signal.Signals(signum).name)

    async def _load_initial_model(self) -> None:
        try:
            await self.runtime.load(self.config.model)
        except ModelLoadFailed as exc:
            # The control plane and API stay up: `mtplxctl status` shows the error and the API
            # answers 503 until a model is loaded.
            log.warning("no model loaded at start: %s", exc)
