"""Control methods of the model store: models.list, models.pull, models.check, models.update,
models.rm and models.catalog.

The store's work is blocking (network, hashing), so it runs on a worker thread. Its progress
events cross back to trio through a memory channel and go out as `models.progress`
notifications on the caller's connection. A caller that disconnects stops its download at the
next chunk; files already finished stay in the store.
"""

from __future__ import annotations

import math
import os
import threading
from pathlib import Path
from typing import Any, Callable

import trio

from mtplxd.control.protocol import RpcError, app_error, invalid_params
from mtplxd.control.registry import MethodRegistry, Notify
from mtplxd.models.catalog import available_models
from mtplxd.models.hub import ModelStoreError
from mtplxd.models.progress import PullCancelled
from mtplxd.models.store import ModelStore
from mtplxd.paths import Paths

PROGRESS_METHOD = "models.progress"


def register_model_store_methods(registry: MethodRegistry, paths: Paths) -> None:
    """Add the models.* methods, backed by the store in `paths.models_dir`, to `registry`."""
    store = ModelStore(paths.models_dir)

    async def models_list(params: dict[str, Any], notify: Notify) -> dict[str, Any]:
        """Pulled models: id, revision, size, family, serving mode (and why), quantization."""
        return {"models": await _blocking(store.list_models)}

    async def models_catalog(params: dict[str, Any], notify: Notify) -> dict[str, Any]:
        """Recommended models for this machine (with the embedded fallback); off the event
        loop: on CUDA it asks nvidia-smi for the GPU's memory."""
        return {"models": await _blocking(available_models)}

    async def models_pull(params: dict[str, Any], notify: Notify) -> dict[str, Any]:
        """Pull `model` (org/name[@revision]); streams models.progress {phase, file, downloaded, total}."""
        spec = _required_str(params, "model")
        return await _streaming(store.pull, spec, notify)

    async def models_check(params: dict[str, Any], notify: Notify) -> dict[str, Any]:
        """For each pulled revision: latest, outdated or unknown (with why) on the Hub."""
        repo = params.get("model") or None
        if repo is not None and not isinstance(repo, str):
            raise invalid_params("model must be a string")
        return {"models": await _blocking(store.check, repo)}

    async def models_update(params: dict[str, Any], notify: Notify) -> dict[str, Any]:
        """Move a pulled repo to the Hub's latest commit, downloading only changed files."""
        spec = _required_str(params, "model")
        return await _streaming(store.update, spec, notify)

    async def models_rm(params: dict[str, Any], notify: Notify) -> dict[str, Any]:
        """Remove a pulled repo, or one `org/name@revision` of it. Refused (reason
        `model_in_use`) for the model the daemon serves, unless `force` is true."""
        spec = _required_str(params, "model")
        force = params.get("force", False)
        if not isinstance(force, bool):
            raise invalid_params("force must be true or false")
        serving = await _serving_folder(registry)
        in_use = serving is not None and store.would_delete(spec, serving)
        if in_use and not force:
            raise in_use_error(spec)
        return {**await _blocking(store.remove, spec), "was_serving": in_use}

    registry.add("models.list", models_list)
    registry.add("models.catalog", models_catalog)
    registry.add("models.pull", models_pull)
    registry.add("models.check", models_check)
    registry.add("models.update", models_update)
    registry.add("models.rm", models_rm)


def _required_str(params: dict[str, Any], key: str) -> str:
    value = params.get(key)
    if value is not None and not isinstance(value, str):
        raise invalid_params(f"{key} must be a string naming a model: a Hub repo id like "
                             f"org/name[@revision], not a {type(value).__name__}")
    if not value or not value.strip():
        raise invalid_params(f"{key} is required: a Hub repo id like org/name[@revision]")
    return value.strip()


async def _no_notify(method: str, params: dict[str, Any]) -> None:
    return None


async def _serving_folder(registry: MethodRegistry) -> Path | None:
    """The folder of the model the daemon serves, from its own `daemon.status`; None when no
    model is loaded, or in a registry without the daemon's methods."""
    status = registry.get("daemon.status")
    if status is None:
        return None
    model = (await status.handler({}, _no_notify)).get("model") or {}
    if model.get("state") != "loaded" or not model.get("path"):
        return None
    return Path(model["path"])


def in_use_error(spec: str) -> RpcError:
    """The refusal to remove the model being served: removing it would leave the next start
    (and `restart`, which loads the same model again) without a model."""
    return app_error("model_in_use",
                     f"{spec} is the model mtplxd (pid {os.getpid()}) is serving; the next "
                     "start or restart could not load it. Load another model first (`mtplxctl "
                     "start --model OTHER`) or stop the daemon (`mtplxctl stop`), then remove it; `mtplxctl "
                     "models rm --force` removes it now")


def store_error(exc: ModelStoreError) -> RpcError:
    """A store failure as the control plane's error (reason kept for scripts)."""
    return app_error(exc.reason, exc.message)


async def _blocking(fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return await trio.to_thread.run_sync(fn, *args)
    except ModelStoreError as exc:
        raise store_error(exc) from None


async def _streaming(fn: Callable[..., Any], spec: str, notify: Notify) -> Any:
    """Run a store operation that reports progress; forward its events as notifications."""
    token = trio.lowlevel.current_trio_token()
    send, receive = trio.open_memory_channel(math.inf)
    stop = threading.Event()

    def emit(event: dict[str, Any]) -> None:
        try:
            trio.from_thread.run_sync(send.send_nowait, event, trio_token=token)
        except (trio.RunFinishedError, trio.BrokenResourceError, trio.ClosedResourceError):
            stop.set()

    async def forward() -> None:
        async with receive:
            async for event in receive:
                if stop.is_set():
                    continue
                try:
                    await notify(PROGRESS_METHOD, event)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    stop.set()  # the caller went away: stop downloading at the next chunk

    result: Any = None
    failure: ModelStoreError | PullCancelled | None = None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(forward)
        try:
            result = await trio.to_thread.run_sync(
                lambda: fn(spec, progress=emit, should_stop=stop.is_set), abandon_on_cancel=True)
        except (ModelStoreError, PullCancelled) as exc:
            failure = exc  # raised below, outside the nursery, so it is not wrapped in a group
        except trio.Cancelled:
            stop.set()  # the daemon is shutting down: let the worker thread end at its next chunk
            raise
        finally:
            send.close()
    if isinstance(failure, ModelStoreError):
        raise store_error(failure)
    if failure is not None:
        raise app_error("cancelled", str(failure))
    return result
