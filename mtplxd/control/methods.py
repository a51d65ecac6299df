"""The daemon's own control methods: daemon.*, model.*, config.*, logs.*.

Handlers stay thin: validate params, ask the one service that knows, return plain JSON.
Subsystems (fans, models, service, ...) register their own namespaces next to these.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Protocol

import psutil

from mtplxd import POWERED_BY, __version__, blas
from mtplxd.api.chat_format import effort_levels
from mtplxd.config import (ConfigError, load_config, set_in_file, settings_now,
                           unknown_setting)
from mtplxd.control.protocol import PROTOCOL_VERSION, app_error, invalid_params
from mtplxd.control.registry import MethodRegistry, Notify
from mtplxd.guard import context_window
from mtplxd.logs import tail
from mtplxd.models.builtin import EMBEDDED_MODEL_ID
from mtplxd.models.resolve import ModelLoadFailed
from mtplxd.tuning import tuning_key

if TYPE_CHECKING:
    from mtplxd.config import Config
    from mtplxd.fans.controller import FanController
    from mtplxd.paths import Paths
    from mtplxd.runtime import Runtime

# Settings the running daemon cannot change under its feet.
# When a changed setting takes effect (docs/cli.md). "depth" applies at once; keys read when a
# model loads wait for the next load; the rest for the next start of the daemon.
LIVE_KEYS = {"depth"}
LOAD_KEYS = {"model", "decode_loop", "cpu_attention", "quantize", "dequantize", "kv_bits", "memory_limit",
             "session_bank_ssd", "session_bank_bytes", "session_bank_ssd_bytes"}
DEMO_HINT = ("mtplx-tiny-coder is a small demo model shipped with mtplx; for real work pull a "
             "Qwen MTP model: `mtplxctl models list --available`, then "
             "`mtplxctl models pull REPO` and `mtplxctl start --model REPO`")
MAX_LOG_LINES = 10_000


class Daemon(Protocol):
    """What these methods need of the running daemon (`mtplxd.daemon.Daemon` is one). A
    protocol, not an import: the daemon module imports this one to register the methods."""

    config: "Config"
    paths: "Paths"
    runtime: "Runtime"
    fans: "FanController"
    supervisor: str | None
    started_at: float

    def request_shutdown(self, why: str) -> None: ...

    def http_status(self) -> dict[str, Any]: ...


def register_daemon_methods(registry: MethodRegistry, daemon: "Daemon") -> None:
    """Add daemon.*, model.*, config.* and logs.* to `registry`."""

    async def daemon_status(params: dict[str, Any], notify: Notify) -> dict[str, Any]:
        """Everything `mtplxctl status` shows."""
        return status_snapshot(daemon)

    async def daemon_shutdown(params: dict[str, Any], notify: Notify) -> dict[str, Any]:
        """Stop the daemon cleanly (drains in-flight requests for a bounded time)."""
        daemon.request_shutdown("control")
        return {"stopping": True, "pid": os.getpid()}

    async def daemon_methods(params: dict[str, Any], notify: Notify) -> dict[str, Any]:
        """The methods this daemon answers."""
        return {"methods": {name: registry.get(name).doc for name in registry.names()}}

    async def model_load(params: dict[str, Any], notify: Notify) -> dict[str, Any]:
        """Load a model (a local folder, a pulled repo, or empty for the configured/default one)."""
        spec = _optional_str(params, "model") or daemon.config.model
        depth = params.get("depth")
        if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or not 0 <= depth <= 16):
            raise invalid_params("depth must be an integer from 0 to 16")
        try:  # the load-time settings as config.toml has them now (`config set`: next_load)
            daemon.runtime.use_load_settings(load_config(daemon.paths.config_file))
        except ConfigError as exc:
            raise app_error("invalid_config", str(exc)) from None
        await notify("model.progress", {"phase": "loading", "model": spec or EMBEDDED_MODEL_ID})
        try:
            info = await daemon.runtime.load(spec, depth)
        except ModelLoadFailed as exc:
            raise app_error("model_load_failed", str(exc)) from None
        daemon.loaded_as = loaded_as(daemon, _optional_str(params, "model"), depth)
        await notify("model.progress", {"phase": "loaded", "model": info["id"]})
        return model_snapshot(daemon)

    async def model_unload(params: dict[str, Any], notify: Notify) -> dict[str, Any]:
        """Unload the model; the API answers 503 until one is loaded again."""
        return {"unloaded": await daemon.runtime.unload()}

    async def config_get(params: dict[str, Any], notify: Notify) -> dict[str, Any]:
        """Effective settings with their source; `key` narrows to one."""
        try:
            current = load_config(daemon.paths.config_file)
        except ConfigError as exc:  # a file the user broke since the start: say so, not a bug
            raise app_error("invalid_config", str(exc)) from None
        table = current.to_dict()
        key = _optional_str(params, "key")
        if key is None:
            return {"settings": table, "file": str(daemon.paths.config_file)}
        if key not in table:
            raise app_error("unknown_setting", str(unknown_setting(key)))
        return {"settings": {key: table[key]}, "file": str(daemon.paths.config_file)}

    async def config_set(params: dict[str, Any], notify: Notify) -> dict[str, Any]:
        """Persist one setting in config.toml (an empty value removes it)."""
        key = _optional_str(params, "key")
        if key is None or "value" not in params:
            raise invalid_params("config.set needs `key` and `value`")
        try:
            value = set_in_file(daemon.paths.config_file, key, params["value"])
        except ConfigError as exc:
            raise app_error("invalid_config", str(exc)) from None
        applies = _apply_live(daemon, key, value)
        return {"key": key, "value": value, "applies": applies,
                "restart_required": applies == "restart"}

    async def logs_tail(params: dict[str, Any], notify: Notify) -> dict[str, Any]:
        """The last `lines` lines of the daemon log."""
        lines = params.get("lines", 100)
        if isinstance(lines, bool) or not isinstance(lines, int) or not 0 <= lines <= MAX_LOG_LINES:
            raise invalid_params(f"lines must be an integer from 0 to {MAX_LOG_LINES}")
        return {"file": str(daemon.paths.log_file), "lines": tail(daemon.paths.log_file, lines)}

    registry.add("daemon.status", daemon_status)
    registry.add("daemon.shutdown", daemon_shutdown)
    registry.add("daemon.methods", daemon_methods)
    registry.add("model.load", model_load)
    registry.add("model.unload", model_unload)
    registry.add("config.get", config_get)
    registry.add("config.set", config_set)
    registry.add("logs.tail", logs_tail)


def _optional_str(params: dict[str, Any], key: str) -> str | None:
    value = params.get(key)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise invalid_params(f"{key} must be a string")
    return value


def _apply_live(daemon: "Daemon", key: str, value: Any) -> str:
    """Apply a changed setting to the running daemon where it can; returns when it takes
    effect: "now", "next_load" (the next model load) or "restart"."""
    if key in LIVE_KEYS:
        depth = None if value in (None, "auto") else value
        if daemon.runtime.set_default_depth(depth):
            return "now"
        return "next_load"
    return "next_load" if key in LOAD_KEYS else "restart"


def loaded_as(daemon: "Daemon", spec: str | None, depth: int | None) -> dict[str, Any]:
    """How the model was asked for over the socket (`start --model X --depth N`, `models
    load`), beside config.toml's model and depth then: `mtplxctl restart` asks for it again
    unless the file has changed those keys since."""
    in_file = settings_now(daemon.paths.config_file)
    return {"spec": spec, "depth": depth,
            "config_model": in_file.get("model"), "config_depth": in_file.get("depth")}


def model_snapshot(daemon: "Daemon") -> dict[str, Any] | None:
    """The model part of status: None when nothing is loaded or loading."""
    runtime = daemon.runtime
    if runtime.state == "none":
        return None
    snapshot: dict[str, Any] = {"state": runtime.state, "error": runtime.error}
    info = runtime.info()
    if info is not None:
        snapshot.update(info)
        # What clients are told is what fits under the memory limit; the model's own stays.
        snapshot.update(context_window(info.get("context_length") or 0, runtime.guard).to_dict())
        served = snapshot.get("context_length") or 0
        # Nothing fits under the memory limit: no output either (an unknown context stays 32k).
        nothing_fits = not served and snapshot.get("context_limited_by") == "memory"
        snapshot["max_output_tokens"] = 0 if nothing_fits else min(served or 32768, 32768)
        template = getattr(runtime.model.tokenizer, "chat_template", None) or ""
        snapshot["reasoning"] = "<think>" in template
        # What a request's reasoning effort may be (others are a 400): agents' writers pick one.
        snapshot["reasoning_efforts"] = list(effort_levels(template)) if template else []
        snapshot["demo"] = info.get("id") == EMBEDDED_MODEL_ID
        # `mtplxctl tune` saves its depth under this key; the next load looks it up.
        snapshot["tuning_key"] = tuning_key(info)
        snapshot["depth_source"] = runtime.depth_source
        snapshot["loaded_as"] = getattr(daemon, "loaded_as", None)
        if snapshot["demo"]:
            snapshot["hint"] = DEMO_HINT
    return snapshot


def status_snapshot(daemon: "Daemon") -> dict[str, Any]:
    """The full `daemon.status` answer."""
    process = psutil.Process()
    vm = psutil.virtual_memory()
    return {
        "protocol": PROTOCOL_VERSION,
        "version": __version__,
        "powered_by": POWERED_BY,
        "pid": os.getpid(),
        "started_at": daemon.started_at,
        "uptime_seconds": round(time.time() - daemon.started_at, 3),
        "home": str(daemon.paths.home),
        "socket": str(daemon.paths.socket),
        "socket_fallback": daemon.paths.socket_is_fallback,
        "supervisor": daemon.supervisor,
        "launch_options": daemon.launch_options,
        "http": daemon.http_status(),
        "model": model_snapshot(daemon),
        "requests": {"active": daemon.runtime.active_requests,
                     "started": daemon.runtime.generations_started},
        "scheduler": daemon.runtime.scheduler_status(),
        "group": daemon.runtime.group_status(),
        "guard": daemon.runtime.guard.status() if daemon.runtime.guard is not None else None,
        "session_bank": daemon.runtime.session_bank_stats() if daemon.runtime.model is not None else None,
        "fans": daemon.fans.snapshot() if getattr(daemon, "fans", None) else None,
        "flight_recorder": daemon.recorder.status() if getattr(daemon, "recorder", None) else None,
        "blas": blas.snapshot(),  # the BLAS this daemon's MLX calls
        "memory": {
            "rss_bytes": process.memory_info().rss,
            "system_total_bytes": vm.total,
            "system_available_bytes": vm.available,
        },
    }
