"""The trio side of the engine: one model-owner thread, reached only through this object.

All MLX work runs on the engine's ModelOwner thread (MLX streams are per thread). A generation
is submitted there as a scheduler row (engine/scheduler.py: FIFO queue, rows stepped one
prefill chunk or decode cycle at a time) and its tokens come back through a memory channel;
cancelling the trio side (a client that disconnects) cancels the row, which leaves at its next
cycle boundary. The memory guard prices each row next to the running ones when it is admitted.
"""

from __future__ import annotations

import json
import logging
import math
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

import psutil
import trio

from mtplxd.engine.interface import RetrievalError
from mtplxd.guard import (DEFAULT_PREFILL_CHUNK, MemoryGuard, is_unified_memory,
                          plan_for_config, resolve_limit, verify_state_bytes)
from mtplxd.models.resolve import ModelLoadFailed, resolve_model

if TYPE_CHECKING:  # the engine (and MLX) loads lazily
    from mtplxd.config import Config
    from mtplxd.engine.decoding.cohort_memory import CohortMemory

log = logging.getLogger(__name__)

SYSTEM_HEADROOM_BYTES = 512 * 1024 * 1024
# Loads of one retrieval model a request may wait for when each is evicted before it runs.
RETRIEVAL_LOAD_TRIES = 3


class ModelNotLoaded(Exception):
    """Generation was asked for while no model is loaded."""


@dataclass(frozen=True)
class BankOptions:
    """The session bank's config keys (docs/session-bank.md); the default keeps it off."""

    ram: str | float = 0  # session_bank_bytes: "auto" or GiB; 0 = off
    ssd_enabled: bool = False  # session_bank_ssd
    ssd_dir: Path | None = None  # MTPLX_HOME/session-bank
    ssd: str | float = "auto"  # session_bank_ssd_bytes


class Runtime:
    """Owns the model-owner thread and the loaded model's lifecycle."""

    def __init__(self, models_dir: Path, default_depth: int | None,
                 memory_limit: str | float = "auto", bank: BankOptions = BankOptions(),
                 decode_loop: str = "auto", quantize: str = "auto",
                 max_concurrent: str | int = "auto", max_queued: int = 64,
                 prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK,
                 tuning_home: Path | None = None, cohorts: str = "auto",
                 cohort_widths: tuple[int, ...] = (1, 3, 8), numerics: str = "auto",
                 cohort_cycle: str = "fused", kv_bits: int | str = "auto",
                 cpu_attention: str = "auto", dequantize: str = "auto") -> None:
        from mtplxd.engine.cohort import normalize_widths
        from mtplxd.engine.owner import ModelOwner
        from mtplxd.engine.scheduler import DEFAULT_MAX_BACKLOG, Scheduler

        self.models_dir = models_dir
        self.default_depth = default_depth
        self.memory_limit = memory_limit
        self.bank_options = bank
        self.decode_loop = decode_loop
        self.quantize = quantize
        self.kv_bits = kv_bits  # attention KV quantization: 0, 4, 8 or "auto" (the model's)
        self.cpu_attention = cpu_attention  # long CPU prefill chunks: auto | numpy | mlx
        self.dequantize = dequantize  # quantized weights as dense float32 on the Linux CPU
        self.max_concurrent_setting = max_concurrent
        self.prefill_chunk_tokens = prefill_chunk_tokens
        # Where `mtplxctl tune` saves depths (MTPLX_HOME); None: tuned depths are not used.
        self.tuning_home = tuning_home
        self.depth_source = "none"  # setting | tuned | model: where the served depth came from
        self.numerics_setting = numerics
        self.scheduler = Scheduler(max_queued=max_queued, admit=self._admit_row,
                                   cohort_mode=cohorts, widths=normalize_widths(cohort_widths),
                                   cohort_cycle=cohort_cycle,
                                   cohort_memory=cohort_memory(lambda: self.guard),
                                   max_backlog=DEFAULT_MAX_BACKLOG)
        self.owner = ModelOwner(scheduler=self.scheduler)
        self.model: Any = None  # mtplxd.engine.LoadedModel once loaded
        # engine/distributed ServingGroup when the model is served over several hosts.
        self.group: Any = None
        self.guard: MemoryGuard | None = None  # the loaded model's memory guard
        self.generations_started = 0  # requests that reached the engine (admitted)
        self.state = "none"  # none | loading | loaded | failed
        self.error: str | None = None
        self.loaded_at: float | None = None
        self.active_requests = 0
        # Called with the in-flight count whenever a generation starts or ends (fans, ...).
        self.activity: list[Callable[[int], None]] = []
        self._load_lock = trio.Lock()
        # (folder, id, depth) of the last model that loaded: a failed load falls back to it.
        self._last_good: tuple[Path, str, int | None] | None = None
        self._idle = trio.Event()
        self._idle.set()
        from mtplxd.engine.retrieval import RetrievalPool

        self.retrieval = RetrievalPool([])  # embedding and reranker models (configure_retrieval)
        self.retrieval_refused: dict[str, list[str]] = {}  # kind -> why each spec is not served
        self._retrieval_locks: dict[str, trio.Lock] = {}  # one load at a time per retrieval model

    def configure_retrieval(self, specs: list[tuple[str, str]], limit: int, trust_remote_code: bool) -> list[str]:
        """Serve the retrieval models `specs` ((model spec, kind) pairs: a folder or a pulled
        repo id, "embedding" or "rerank"), at most `limit` resident. They load on first use.
        Returns one line per spec that resolves to no model (it is left out)."""
        from mtplxd.engine.retrieval import RetrievalPool, RetrievalSpec

        resolved, problems = [], []
        self.retrieval_refused = {}
        for spec, kind in specs:
            try:
                path, model_id = resolve_model(spec, self.models_dir)
            except ModelLoadFailed as exc:
                problems.append(f"{kind} model {spec}: {exc}")
                self.retrieval_refused.setdefault(kind, []).append(f"{spec}, which cannot be loaded ({exc})")
                continue
            resolved.append(RetrievalSpec(model_id, path, kind))
        self.retrieval = RetrievalPool(resolved, limit, trust_remote_code)
        return problems

    async def run_retrieval(self, model_id: str, fn: Callable[[Any], Any]) -> Any:
        """Run `fn(retrieval model)` on the owner thread, loading the model first if it is not
        resident. One call is one batch, and a load is many small owner jobs (engine/retrieval.py
        `RetrievalPool.begin_load`): chat rows wait at most one batch or one load step."""
        pool = self.retrieval
        for _ in range(RETRIEVAL_LOAD_TRIES):
            await self._load_retrieval(pool, model_id)
            # The model can be evicted between its last load step and this job (memory
            # pressure, or another model's load): then it loads again, in steps as before.
            ran, result = await self._on_owner(partial(_run_if_resident, pool, model_id, fn))
            if ran:
                return result
        raise RetrievalError("load_failed", f"retrieval model {model_id} was unloaded again "
                             f"before it could run, {RETRIEVAL_LOAD_TRIES} times: memory is too "
                             "tight to keep it loaded: free memory or lower retrieval_resident_limit")

    async def _load_retrieval(self, pool: Any, model_id: str) -> None:
        """Make `model_id` resident, one owner job per load step; concurrent first requests for
        the same model wait for one load instead of starting their own."""
        async with self._retrieval_locks.setdefault(model_id, trio.Lock()):
            if pool.is_resident(model_id):
                return
            started = time.monotonic()
            try:
                steps = await self._on_owner(partial(pool.begin_load, model_id))
                for index in range(steps):
                    await self._on_owner(partial(pool.load_step, model_id, index))
                await self._on_owner(partial(pool.finish_load, model_id))
            except BaseException:
                # A cancelled request (client gone) leaves no half-loaded model behind; the
                # pool has already dropped one that failed (then this is a no-op).
                self.owner.submit(partial(pool.abandon_load, model_id))
                raise
            log.info("retrieval model %s loaded in %d steps in %.2f s", model_id, steps,
                     time.monotonic() - started)

    def release_retrieval(self) -> None:
        """Drop the resident retrieval models (memory pressure); they reload on next use."""
        self.owner.submit(self.retrieval.release)

    def start(self) -> None:
        """Start the owner thread, with the scheduler's row limit resolved for this machine."""
        from mtplxd.engine.cohort import resolve_numerics
        from mtplxd.engine.scheduler import default_max_concurrent

        setting = self.max_concurrent_setting
        self.scheduler.configure(
            max_concurrent=default_max_concurrent() if setting == "auto" else int(setting),
            numerics=resolve_numerics(self.numerics_setting))
        self.owner.start()

    def stop(self) -> None:
        """Cancel what still runs, drop the model on the owner thread (MLX frees it there),
        then end the thread."""
        self.scheduler.cancel_all()
        model, self.model, self.guard = self.model, None, None
        try:
            # The bank finishes its queued disk writes (bounded) before the process goes.
            self.owner.submit(lambda: _retire(model)).result(timeout=60)
        except Exception as exc:  # shutting down anyway; the log says why memory was not freed
            log.warning("could not release MLX memory at stop: %s", exc)
        if self.group is not None:
            try:
                self.owner.submit(self.group.stop).result(timeout=60)
            except Exception as exc:  # workers also exit on their own when the ring breaks
                log.warning("could not stop the distributed group cleanly: %s", exc)
        self.owner.stop()

    async def _on_owner(self, fn: Callable[[], Any]) -> Any:
        future = self.owner.submit(fn)
        return await trio.to_thread.run_sync(future.result, abandon_on_cancel=True)

    def info(self) -> dict[str, Any] | None:
        """The loaded model's facts (None when no model is loaded)."""
        return self.model.info.to_dict() if self.model is not None else None

    async def load(self, spec: str | None, depth: int | None = None) -> dict[str, Any]:
        """Resolve and load `spec`, replacing any loaded model; returns the model's info."""
        async with self._load_lock:
            path, model_id = resolve_model(spec, self.models_dir)
            self.state, self.error = "loading", None
            log.info("loading model %s from %s", model_id, path)
            # The old model goes before the new one loads: two never sit in memory together.
            previous, self.model, self.guard = self.model, None, None
            if previous is not None:
                self.scheduler.cancel_all()  # its rows end at their next cycle, before it goes
                await self._on_owner(partial(_retire, previous))
                previous = None
            depth = self.default_depth if depth is None else depth
            try:
                info = await self._load_resolved(path, model_id, depth)
            except Exception as exc:
                self.state, self.error = "failed", str(exc)
                log.error("model load failed: %s", exc)
                raise ModelLoadFailed(str(exc) + await self._fall_back(model_id, exc)) from exc
            self._last_good = (path, model_id, depth)
            return info

    async def _load_resolved(self, path: Path, model_id: str, depth: int | None) -> dict[str, Any]:
        """Load a resolved model folder and make it the served model (guard, bank, limits)."""
        from mtplxd.engine import load_model

        started = time.monotonic()
        limit = resolve_limit(self.memory_limit, psutil.virtual_memory().total)
        if self.group is not None:
            model = await self._on_owner(lambda: self.group.load(
                path, model_id=model_id, depth=depth, quantize=self.quantize,
                dequantize=self.dequantize))
        else:
            model = await self._on_owner(lambda: load_model(
                path, model_id=model_id, depth=depth, decode_loop=self.decode_loop,
                quantize=self.quantize, kv_bits=self.kv_bits,
                cpu_attention=self.cpu_attention, dequantize_weights=self.dequantize,
                memory_limit_bytes=limit))
        if self.group is None:  # a bank would have to copy the workers' caches too
            await self._enable_session_bank(model, limit)
        self.guard = build_guard(path, model, limit)
        self.depth_source = "setting" if depth is not None else self._apply_tuned_depth(model)
        await self._on_owner(lambda: apply_mlx_limits(self.guard))
        self.model, self.state, self.loaded_at = model, "loaded", time.time()
        log.info("loaded %s in %.1fs (%s)", model_id, time.monotonic() - started, model.info.mode)
        return model.info.to_dict()

    def _apply_tuned_depth(self, model: Any) -> str:
        """With `depth = auto`: serve the depth `mtplxctl tune` saved for this model on this
        machine, if any; returns where the served depth comes from."""
        from mtplxd.tuning import tuned_depth, tuning_key

        if self.tuning_home is None or model.head is None:
            return "model"
        tuned = tuned_depth(self.tuning_home, tuning_key(model.info.to_dict()))
        if tuned is None:
            return "model"
        log.info("depth %d for %s from mtplxctl tune (%s)", tuned, model.info.id,
                 self.tuning_home / "tuning.json")
        model.serve_depth(tuned)
        return "tuned"

    async def _fall_back(self, failed_id: str, exc: Exception) -> str:
        """After a failed load, serve the last model that loaded again (the old one was retired
        first, so two never sit in memory together); returns what to add to the error."""
        if self._last_good is None:
            return "; no model is loaded now (`mtplxctl start` loads the default one)"
        path, model_id, depth = self._last_good
        try:
            await self._load_resolved(path, model_id, depth)
        except Exception as again:
            self.state, self.error = "failed", f"{exc}; reloading {model_id} failed too: {again}"
            log.error("could not reload the last good model %s: %s", model_id, again)
            return f"; reloading the previous model {model_id} failed too: {again}"
        self.error = f"loading {failed_id} failed: {exc}; serving {model_id} again"
        log.warning("%s", self.error)
        return f"; still serving the previous model {model_id}"

    def use_load_settings(self, config: "Config") -> None:
        """Take the settings a model load reads (the control plane's LOAD_KEYS but `model`)
        from `config`, config.toml as it is now: the daemon's start, and each model.load, so
        that a `config set` of one of them applies at the next load, as it says."""
        self.decode_loop, self.quantize = config.decode_loop, config.quantize
        self.kv_bits, self.cpu_attention = config.kv_bits, config.cpu_attention
        self.dequantize, self.memory_limit = config.dequantize, config.memory_limit
        self.bank_options = replace(self.bank_options, ram=config.session_bank_bytes,
                                    ssd_enabled=config.session_bank_ssd, ssd=config.session_bank_ssd_bytes)

    def set_default_depth(self, depth: int | None) -> bool:
        """Make `depth` (None: the model's recommended one) the default of later loads and, when
        a number, of the loaded model's next requests; True when the loaded model (or the lack
        of one) is served at it from now on, False when it waits for the next load."""
        self.default_depth = depth
        model = self.model
        if model is None:
            return True
        if depth is None:
            return False  # the recommended depth is worked out at load
        if model.head is not None:
            model.serve_depth(depth)
            self.depth_source = "setting"
        return True

    async def unload(self) -> bool:
        """Drop the loaded model; returns whether one was loaded."""
        async with self._load_lock:
            model = self.model
            self.model, self.state, self.error, self.loaded_at = None, "none", None, None
            self._last_good = None  # unloaded on purpose: a later failed load falls back to none
            self.guard = None
            if model is not None:
                self.scheduler.cancel_all()
                await self._on_owner(lambda: _retire(model))
            return model is not None

    async def _enable_session_bank(self, model: Any, limit_bytes: int) -> None:
        """Give a freshly loaded model its session bank, sized from the memory limit."""
        from mtplxd.engine.session.bank import bank_settings

        options = self.bank_options
        settings = bank_settings(options.ram, options.ssd_enabled and options.ssd_dir is not None,
                                 options.ssd_dir or Path(), options.ssd,
                                 limit_bytes=limit_bytes,
                                 weights_bytes=model.info.weights_bytes)
        if settings is not None:
            await self._on_owner(lambda: model.enable_session_bank(settings))

    def session_bank_note(self) -> str | None:
        """Why the session bank runs degraded (its SSD store moved aside or off), or None."""
        bank = getattr(self.model, "session_bank", None)
        return bank.health_note() if bank is not None else None

    def session_bank_stats(self) -> dict[str, Any]:
        """The session bank's counters for status (enabled: False when it is off)."""
        bank = getattr(self.model, "session_bank", None)
        return bank.stats() if bank is not None else {"enabled": False}

    def require_model(self) -> Any:
        if self.model is None:
            raise ModelNotLoaded(f"no model is loaded (state: {self.state})")
        return self.model

    def group_status(self) -> dict[str, Any] | None:
        """The distributed group's ranks, split, link and lost reason (None: one host)."""
        return self.group.status() if self.group is not None else None

    def scheduler_status(self) -> dict[str, Any]:
        """The scheduler's limits, running rows and queue (status, /metrics, flight board)."""
        return self.scheduler.status()

    @asynccontextmanager
    async def generate(self, request: Any) -> AsyncIterator[AsyncIterator[Any]]:
        """Queue one generation as a scheduler row; yields an async iterator of engine items.

        Raises InsufficientMemory at once for a request that could never fit, and QueueFull
        when `max_queued` requests already wait. Leaving the `async with` early (a disconnect,
        a cancel) cancels the row: it leaves at its next cycle boundary.
        """
        from mtplxd.engine.interface import GenerationResult
        from mtplxd.engine.scheduler import Row, RowFailure

        model = self.require_model()
        if self.guard is not None:
            # A request that can never fit is refused now; one that fits later waits its turn.
            self.guard.check(len(request.prompt_ids), request.sampling.max_tokens,
                             self._extra_bytes(model, request))
        if request.prefill_chunk is None:
            request.prefill_chunk = self.prefill_chunk_tokens
        send, receive = trio.open_memory_channel(math.inf)
        token = trio.lowlevel.current_trio_token()
        row: Row

        def put(item: Any) -> None:  # trio thread
            try:
                send.send_nowait(item)
                if isinstance(item, (RowFailure, GenerationResult)):
                    send.close()  # a result or a failure is the row's last item
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                row.cancel()

        def deliver(item: Any) -> None:  # owner thread: never waits for trio
            try:
                token.run_sync_soon(put, item)
            except trio.RunFinishedError:
                row.cancel()

        row = Row(request, lambda should_stop, cohort=False: model.generate_steps(
            request, should_stop, cohort=cohort), deliver, cohort_capable=True)
        self.owner.submit_row(row)
        self._begin()
        try:
            self.generations_started += 1
            async with receive:
                yield _unwrap(receive, row)
        finally:
            row.cancel()
            self._end()

    def _admit_row(self, request: Any) -> Callable[[], None] | None:
        """The scheduler's admission hook (owner thread): reserve the row's memory next to
        the running rows; None while it must wait for them, lowering its prefill chunk when
        that is what fits."""
        guard = self.guard
        if guard is None:
            return lambda: None
        chunk = request.prefill_chunk or self.prefill_chunk_tokens
        reservation = guard.try_admit(len(request.prompt_ids), request.sampling.max_tokens, chunk,
                                      self._extra_bytes(self.require_model(), request))
        if reservation is None:
            return None
        request.prefill_chunk = min(chunk, reservation.prefill_chunk)
        return reservation.release

    def _extra_bytes(self, model: Any, request: Any) -> int:
        """What a request costs the guard beyond its prompt, output and one prefill chunk:
        its images, and a hybrid's every-row GDN verify (guard.verify_state_bytes)."""
        try:
            depth = model.resolve_depth(request.depth)
        except ValueError:
            depth = 0  # refused with its own error when it runs
        verify = verify_state_bytes(self.guard.plan, depth, model.info.kernels.get("gdn_verify"))
        return image_bytes(request) + verify

    async def run_on_model(self, fn: Callable[[Any], Any]) -> Any:
        """Run `fn(model)` on the owner thread (prompt scoring, token counting)."""
        model = self.require_model()
        return await self._on_owner(lambda: fn(model))

    def _begin(self) -> None:
        self.active_requests += 1
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        self._report_activity()

    def _end(self) -> None:
        self.active_requests -= 1
        if self.active_requests == 0:
            self._idle.set()
        self._report_activity()

    def _report_activity(self) -> None:
        for callback in self.activity:
            callback(self.active_requests)

    async def wait_idle(self) -> None:
        """Return once no generation is in flight."""
        await self._idle.wait()


async def _unwrap(receive: trio.MemoryReceiveChannel, row: Any) -> AsyncIterator[Any]:
    from mtplxd.engine.scheduler import RowFailure

    async for item in receive:
        row.consumed()  # taken: a row paused for this reader's backlog may go on
        if isinstance(item, RowFailure):
            raise item.error
        yield item


def cohort_memory(guard_of: Callable[[], MemoryGuard | None]) -> CohortMemory:
    """The fused cohorts' padding callbacks (engine/decoding/cohort_memory.py) backed by
    the loaded model's guard, looked up at each call (a reload replaces it; no guard:
    everything fits)."""
    from mtplxd.engine.decoding.cohort_memory import CohortMemory

    def hold(key: Any, buffer_bytes: int, ceilings: list[int], must: bool) -> bool:
        guard = guard_of()
        return guard is None or guard.hold_cohort(key, buffer_bytes, ceilings, must)

    def free(key: Any) -> None:
        guard = guard_of()
        if guard is not None:
            guard.free_cohort(key)

    return CohortMemory(hold, free)


def build_guard(path: Path, model: Any, limit_bytes: int) -> MemoryGuard:
    """The memory guard of a freshly loaded model, from its config.json geometry."""
    config = json.loads((Path(path) / "config.json").read_text())
    plan = plan_for_config(config, model.info.weights_bytes, model.info.dtype,
                           kv_bits=getattr(model.info, "kv_bits", 0))

    def system_available() -> int:
        # Other processes count too: never plan into memory the OS does not have to give.
        return psutil.virtual_memory().available - SYSTEM_HEADROOM_BYTES

    bank = getattr(model, "session_bank", None)
    return MemoryGuard(
        plan, limit_bytes,
        bank_bytes=bank.bytes_held if bank is not None else (lambda: 0),
        release_bank=bank.release_idle if bank is not None else (lambda needed: 0),
        system_available=system_available, serial=False,
    )


def apply_mlx_limits(guard: MemoryGuard) -> None:
    """Tell MLX the limit (owner thread); on Apple Silicon also wire the weights when they fit."""
    import mlx.core as mx

    mx.set_memory_limit(guard.limit_bytes)
    if is_unified_memory():
        try:
            mx.set_wired_limit(min(guard.plan.weights_bytes, guard.limit_bytes))
        except (AttributeError, ValueError, RuntimeError) as exc:
            log.info("wired limit not applied: %s", exc)


def _run_if_resident(pool: Any, model_id: str, fn: Callable[[Any], Any]) -> tuple[bool, Any]:
    """(True, fn(model)) when `model_id` is loaded, else (False, None); on the owner thread."""
    model = pool.resident_model(model_id)
    return (False, None) if model is None else (True, fn(model))


def _retire(model: Any) -> None:
    """Close a model that is being replaced or unloaded (owner thread): flush its bank, free MLX."""
    bank = getattr(model, "session_bank", None)
    if bank is not None:
        bank.close()
    del model
    _release_mlx_memory()


def _release_mlx_memory() -> None:
    import gc

    import mlx.core as mx

    gc.collect()
    mx.clear_cache()


def image_bytes(request: Any) -> int:
    """What a request's images cost the memory guard beyond their prompt rows."""
    return sum(image.price_bytes for image in getattr(request, "images", None) or [])
