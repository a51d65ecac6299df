"""Device-resident speculative decoding: each cycle is one compiled graph.

Why: a small model on a GPU is bound by kernel launches and by the host building graphs,
not by weight reads. The stepwise loop (speculative.py) reads each cycle's accepted count
back to the host before it can trim the caches and build the next cycle, so the device
waits for the host every cycle. Here everything a cycle decides stays on the device: the
cache offsets, the accepted count and the PENDING rows are arrays, so cycle c+1 is built
on cycle c's lazy results and the host reads tokens one cycle behind, as AR does. Every
cycle has the same shapes (the cache is a fixed-capacity buffer, the PENDING pass is
always K+1 rows with the invalid ones ignored), so `mx.compile` traces it once per cache
capacity and replays it after that. AR requests on dense models keep autoregressive.py's
loop, which is pipelined already, and whose exact-length single-token attention measured
faster on the H200 than a masked step over the fixed buffer (1.25 against 1.41 ms); hybrid
models on CUDA decode AR in fused_ar.py, this machinery at one token a step.

The arithmetic is the stepwise loop's (speculative.py's docstring has the cycle; the same
acceptance and residual functions are called), so greedy MTP equals AR here too, bitwise
on the CPU backend. What differs: a sampled cycle takes all its random numbers from one
draw, keyed on the device by the (lazy) absolute position (`_cycle_noise`), and draws by
Gumbel-max with them, so a seeded sampled request gives other (equally distributed) tokens
than the stepwise loop.

Dense models (every trunk cache entry attention KV) and, for a request's own decode, hybrid
ones: a Gated DeltaNet layer's conv and recurrent state ride in the cycle's state too, and
the cycle rolls them back to the accepted rows on the device (fused_gdn.py). Cohorts of
hybrid rows keep the stepwise loops (fused_supported's `hybrid`).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Sequence

import mlx.core as mx
import mlx_lm.models.qwen3 as mlx_lm_qwen3
import mlx_lm.models.qwen3_next as mlx_lm_qwen3_next
from mlx_lm.models.cache import KVCache

from mtplxd.engine.decoding import buffer_attention
from mtplxd.engine.decoding.compiled import per_thread
from mtplxd.engine.decoding.sampling import (
    CYCLE, TokenHistory, apply_penalties, device_position_keys, draft_weights, graph_key,
    history_rows, one_hot, scaled_logits, seed_words,
)
from mtplxd.engine.decoding.speculative import (
    AcceptanceStats, acceptance_probability, feed_pending_pairs, log_weights,
    residual_distribution,
)
from mtplxd.engine.decoding.fused_gdn import FusedGDNCache
from mtplxd.engine.decoding.split import CycleSplit, evaluated_at
from mtplxd.engine.interface import SamplingParams
from mtplxd.engine.model import cpu_attention, small_m_qmm
from mtplxd.engine.model.mtp_head import MTPHead
from mtplxd.engine.model.rollback import RollbackArraysCache
from mtplxd.engine.model.trunk import Trunk

CAPACITY_STEP = 256  # cache buffers grow this many slots at a time (one retrace each)


class StaticKVCache:
    """An attention cache for mlx-lm layers: a fixed-capacity buffer and an array offset.

    `update_and_fetch` writes the new keys at `offset` (a device scalar) and hands attention
    the whole buffer; `make_mask` hides every slot past each query's own position (on CUDA
    `static_cache_attention` reads only those slots instead, and the mask goes unused). The
    offset is not advanced here: the cycle sets it, because a PENDING pass writes K+1 rows
    of which only the accepted ones count.

    The rows go in with one put_along_axis (a scatter) each for keys and values, not a
    slice_update at the array offset: MLX's CUDA backend (0.32) runs a slice_update whose
    start is an array as one thread per element of the whole destination buffer
    (`copy_general_dynamic` sizes its grid by `out.data_size()`), so every layer's write
    cost grew with the buffer. On an H100 (Qwen3-32B 4-bit, 512 tokens in a 768-slot
    buffer) those writes took 3.3 ms of a 23.4 ms compiled AR step's device time, 25.8 us
    each (docs/benchmarks.md, "The 32B's AR step compiled, and the KV write that read the
    whole buffer"); a scatter's grid is the written rows' elements. The buffer's contents
    are the same either way.

    The scatter's index is built once for all caches that share `shared` and the offset
    array (a forward's layers: `static_caches`), not once a layer: on CUDA each build is an
    arange and an add, two launches of a few microseconds for one element's worth of work
    (a 4B's compiled AR step under Nsight, docs/benchmarks.md "The 4B's decode steps on the
    kernel").
    """

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array,
                 shared: dict | None = None) -> None:
        self.keys, self.values, self.offset = keys, values, offset
        self.shared = {} if shared is None else shared

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write (B, heads, n, D) keys and values at the offset; return the whole buffers."""
        if not _scatter_works():  # a backend without put_along_axis
            self.keys = _write_at(self.keys, keys, self.offset)
            self.values = _write_at(self.values, values, self.offset)
            return self.keys, self.values
        index = _shared_slot_index(self.shared, self.offset, keys.shape)
        self.keys = mx.put_along_axis(self.keys, index, keys, axis=2)
        self.values = mx.put_along_axis(self.values, index, values, axis=2)
        return self.keys, self.values

    def make_mask(self, n: int, return_array: bool = False,
                  window_size: int | None = None) -> mx.array:
        """(n, capacity) boolean mask: query i sees slots 0..offset+i."""
        if window_size is not None:
            raise ValueError("StaticKVCache does not support sliding-window attention")
        slots = mx.arange(self.keys.shape[2])[None]
        return slots <= self.offset + mx.arange(n)[:, None]


class RowsKVCache:
    """An attention cache over W rows' fixed-capacity buffers, each row at its own offset.

    `offset` is a (W,) int32 device array. `update_and_fetch` writes each row's new keys at
    its own offset (one scatter) and hands attention the whole buffers; `make_mask` gives
    each row its own causal mask over the buffer. mlx-lm's RoPE takes the (W,) offsets as
    they are (one position per row). As with fused.StaticKVCache, the cycle sets the offsets.
    """

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array,
                 shared: dict | None = None) -> None:
        self.keys, self.values, self.offset = keys, values, offset
        # The write index, shared by caches that share an offset array (a forward's layers:
        # fused_cohort.rows_caches), so it is built once per forward, not once per layer.
        self.shared = {} if shared is None else shared

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write (W, heads, n, D) keys and values at each row's offset; return the buffers."""
        if not _scatter_works():  # a backend without put_along_axis: one slice_update per row
            for name, new in (("keys", keys), ("values", values)):
                buffer = getattr(self, name)
                rows = [_write_at(buffer[w:w + 1], new[w:w + 1], self.offset[w])
                        for w in range(new.shape[0])]
                setattr(self, name, mx.concatenate(rows))
            return self.keys, self.values
        index = _shared_slot_index(self.shared, self.offset, keys.shape)
        self.keys = mx.put_along_axis(self.keys, index, keys, axis=2)
        self.values = mx.put_along_axis(self.values, index, values, axis=2)
        return self.keys, self.values

    def make_mask(self, n: int, return_array: bool = False,
                  window_size: int | None = None) -> mx.array:
        """(W, 1, n, capacity) boolean mask: row w's query i sees slots 0..offset[w]+i."""
        if window_size is not None:
            raise ValueError("RowsKVCache does not support sliding-window attention")
        slots = mx.arange(self.keys.shape[2])[None, None, None]
        last = self.offset[:, None, None, None] + mx.arange(n)[None, None, :, None]
        return slots <= last


def _shared_slot_index(shared: dict, offset: mx.array, shape: tuple[int, ...]) -> mx.array:
    """`_slot_index` for rows written at `offset` (a device scalar, or one per row), kept in
    `shared` while the caches that hold it see the same offset array and shape."""
    if shared.get("offset") is not offset or shared.get("shape") != shape:
        offsets = offset if offset.ndim == 1 else offset.reshape(1)
        shared.update(offset=offset, shape=shape, index=_slot_index(offsets, shape))
    return shared["index"]


def _slot_index(offsets: mx.array, shape: tuple[int, ...]) -> mx.array:
    """put_along_axis's index along the slots for (W, heads, n, D) rows, row w written from
    slot offsets[w] on (offsets: a (W,) device array)."""
    slots = (offsets[:, None] + mx.arange(shape[2])[None]).astype(mx.int32)
    return mx.broadcast_to(slots[:, None, :, None], shape)


def _write_at(buffer: mx.array, rows: mx.array, offset: mx.array) -> mx.array:
    """`buffer` (1, heads, S, D) with `rows` written from slot `offset` (a device scalar), by
    slice_update: the fallback where put_along_axis does not run (its CUDA cost grows with
    the buffer: StaticKVCache's docstring)."""
    start = mx.concatenate([mx.zeros((2,), mx.int32), offset.reshape(1).astype(mx.int32),
                            mx.zeros((1,), mx.int32)])
    return mx.slice_update(buffer, rows, start, axes=(0, 1, 2, 3))


_SCATTER_WORKS: bool | None = None


def _scatter_works() -> bool:
    """Whether this backend runs put_along_axis (checked once, at routing time, before any
    graph is traced: it evaluates an array)."""
    global _SCATTER_WORKS
    if _SCATTER_WORKS is None:
        try:
            probe = mx.put_along_axis(mx.zeros((2, 1, 4, 2)), mx.ones((2, 1, 1, 2), mx.int32),
                                      mx.ones((2, 1, 1, 2)), axis=2)
            _SCATTER_WORKS = mx.sum(probe).item() == 4.0
        except Exception:  # noqa: BLE001 - any failure means "use the per-row writes"
            _SCATTER_WORKS = False
    return _SCATTER_WORKS


@contextmanager
def slice_update_writes() -> Iterator[None]:
    """Inside, the caches write their rows by slice_update, as before 2026-12-06 and as where
    put_along_axis does not run (benches: `bench.real_size --kv-write-beside` times it beside
    the scatter in one process). A graph traced inside keeps that write, and one traced
    before keeps the scatter: callers drop the traced graphs on the way in and out."""
    global _SCATTER_WORKS
    before = _scatter_works()
    _SCATTER_WORKS = False
    try:
        yield
    finally:
        _SCATTER_WORKS = before


def static_cache_attention(queries: mx.array, keys: mx.array, values: mx.array, cache: Any,
                           scale: float, mask: Any, sinks: mx.array | None = None) -> mx.array:
    """mlx-lm's attention, except over a StaticKVCache or RowsKVCache on CUDA: there one kernel
    that reads each query's visible slots (buffer_attention.py says why) instead of a masked
    call. Every other call goes on to cpu_attention's dispatch (long CPU prefill chunks in
    numpy)."""
    if (isinstance(cache, StaticKVCache) and sinks is None and buffer_attention.usable()
            and buffer_attention.shape_supported(queries, keys)):
        return buffer_attention.buffer_attention(queries, keys, values, cache.offset, scale)
    if (isinstance(cache, RowsKVCache) and sinks is None and buffer_attention.rows_usable()
            and buffer_attention.rows_shape_supported(queries, keys)):
        return buffer_attention.rows_buffer_attention(queries, keys, values, cache.offset, scale)
    return cpu_attention.attention(queries, keys, values, cache=cache, scale=scale, mask=mask,
                                   sinks=sinks)


def route_static_cache_attention() -> None:
    """Make mlx-lm's qwen3 layers and qwen3_next's attention, which the qwen3_5 hybrids
    share (trunk and MTP layer), call `static_cache_attention`.

    mlx-lm's Attention calls its module's `scaled_dot_product_attention` and offers no other
    hook. The replacement behaves as the original for every cache but a StaticKVCache, which
    only the fused cycles create, so installing it once for the process is safe. The kernels'
    one-time probes run here, before any graph is traced (they evaluate arrays).
    """
    buffer_attention.prepare_form()
    buffer_attention.rows_usable()
    _scatter_works()
    mlx_lm_qwen3.scaled_dot_product_attention = static_cache_attention
    mlx_lm_qwen3_next.scaled_dot_product_attention = static_cache_attention


def fused_supported(trunk: Trunk, cache: list[Any], *, hybrid: bool = False) -> bool:
    """True when every trunk cache entry is plain attention KV (the fused loops' domain), or
    with `hybrid` (FusedSpeculativeDecoder alone, not the cohorts) attention KV and Gated
    DeltaNet rollback caches."""
    kinds = set(cache_layout(cache))
    return trunk.has_hidden and kinds <= ({"kv", "gdn"} if hybrid else {"kv"})


def cache_layout(cache: list[Any]) -> tuple[str, ...]:
    """Each trunk cache entry's kind, in layer order: "kv" (attention KV), "gdn" (a Gated
    DeltaNet rollback cache) or "other"."""
    return tuple("kv" if isinstance(entry, KVCache) else "gdn" if isinstance(entry, RollbackArraysCache)
                 else "other" for entry in cache)


def capacity_for(tokens: int) -> int:
    """Buffer slots for `tokens` cached tokens: the next multiple of CAPACITY_STEP."""
    return max(CAPACITY_STEP, -(-tokens // CAPACITY_STEP) * CAPACITY_STEP)


def reach_for(ceiling: int, depth: int) -> int:
    """The most buffer slots a row of `ceiling` tokens (prompt + max output, the length the
    memory guard priced it for) at `depth` may need. Its last read may overshoot its ceiling
    by `depth` tokens (a cycle commits up to depth + 1), and the cycle after next writes up
    to 2(depth + 1) more (the growth rule), so ceiling + 3 depth + 2 slots, rounded up."""
    return capacity_for(ceiling + 3 * depth + 2)


def grown_capacity(longest: int, depth: int, reach: int) -> int:
    """The capacity to grow to once the cycle after next could write past the buffers (rows
    read back up to `longest` tokens): a step ahead (fewer copies and retraces), but never
    past `reach` (what the memory guard priced), and always room for those writes."""
    needed = capacity_for(longest + 2 * (depth + 1) + 1)
    return max(needed, min(capacity_for(longest + CAPACITY_STEP), reach))


def to_buffers(cache: list[KVCache], capacity: int) -> list[mx.array]:
    """[k0, v0, k1, v1, ...]: each entry's cached rows at the front of a `capacity` buffer."""
    rows = [array[..., :entry.offset, :] for entry in cache for array in (entry.keys, entry.values)]
    return grow_buffers(rows, capacity)


def grow_buffers(buffers: list[mx.array], capacity: int) -> list[mx.array]:
    """The same buffers with free slots appended up to `capacity` (lazy)."""
    out = []
    for array in buffers:
        missing = capacity - array.shape[2]
        pad = mx.zeros((*array.shape[:2], missing, array.shape[3]), array.dtype)
        out.append(mx.concatenate([array, pad], axis=2) if missing > 0 else array)
    return out


def to_kv_caches(buffers: list[mx.array], length: int) -> list[KVCache]:
    """Plain KVCaches over the buffers with `length` rows cached (the session bank and every
    caller after decoding see an ordinary cache; the free slots stay as its spare room)."""
    caches = []
    for i in range(0, len(buffers), 2):
        entry = KVCache()
        entry.state = (buffers[i], buffers[i + 1], length)
        caches.append(entry)
    return caches


def gdn_caches(arrays: list[mx.array]) -> list[RollbackArraysCache]:
    """Rollback caches over [conv0, state0, conv1, ...]: a hybrid trunk's Gated DeltaNet
    layers as the stepwise loop and the session bank hold them."""
    caches = []
    for i in range(0, len(arrays), 2):
        entry = RollbackArraysCache(2)
        entry.cache[0], entry.cache[1] = arrays[i], arrays[i + 1]
        caches.append(entry)
    return caches


def in_layer_order(layout: tuple[str, ...], attention: Iterable[Any], recurrent: Iterable[Any]) -> list[Any]:
    """The `attention` entries at the layout's "kv" layers and the `recurrent` ones at its
    "gdn" layers, each in order: one trunk cache list."""
    attention, recurrent = iter(attention), iter(recurrent)
    return [next(attention) if kind == "kv" else next(recurrent) for kind in layout]


def entries_of(cache: list[Any], layout: tuple[str, ...], kind: str) -> list[Any]:
    """The trunk cache's entries of one kind ("kv" or "gdn"), in layer order."""
    return [entry for entry, entry_kind in zip(cache, layout) if entry_kind == kind]


def trunk_caches(s: "_CycleState", layout: tuple[str, ...]) -> list[StaticKVCache | FusedGDNCache]:
    """A cycle's trunk caches in layer order: StaticKVCaches over the KV buffers at the
    cycle's start, and for a hybrid's Gated DeltaNet layers FusedGDNCaches over their state."""
    return in_layer_order(layout, static_caches(s.trunk_kv, s.n),
                          (FusedGDNCache(s.gdn[i], s.gdn[i + 1]) for i in range(0, len(s.gdn), 2)))


def empty_head_buffers(trunk: Trunk, head: MTPHead, capacity: int) -> list[mx.array]:
    """Zero buffers for the head's one attention layer (qwen3's or qwen3_next's attention)."""
    attention = head.layers[0].self_attn
    dtype = trunk.embed(mx.array([[0]])).dtype
    kv_heads = getattr(attention, "n_kv_heads", None) or attention.num_key_value_heads
    shape = (1, kv_heads, capacity, trunk.text.args.head_dim)
    return [mx.zeros(shape, dtype), mx.zeros(shape, dtype)]


def static_caches(buffers: list[mx.array], offset: mx.array) -> list[StaticKVCache]:
    """One StaticKVCache per [keys, values] pair of `buffers`, all at `offset`, held as a view
    of a 16-byte vector (buffer_attention.in_device_memory: on CUDA, out of MLX's managed
    pool)."""
    offset, shared = buffer_attention.in_device_memory(offset), {}
    return [StaticKVCache(buffers[i], buffers[i + 1], offset, shared)
            for i in range(0, len(buffers), 2)]


def buffers_of(caches: list[StaticKVCache] | list[RowsKVCache]) -> list[mx.array]:
    """[k0, v0, k1, v1, ...] of the caches' buffers (the inverse of `static_caches`)."""
    return [array for entry in caches for array in (entry.keys, entry.values)]


def compiled_graph(trunk: Trunk, key: tuple, build: Callable[[], Callable]) -> Callable:
    """The trunk's compiled function for `key` on this thread, built on first use (a small
    LRU: room for 5 sampling setups' cycle and its two timed halves; compiled.py says why
    per thread)."""
    return per_thread(trunk.compiled_graphs, key, lambda: mx.compile(build()), slots=16)


# --- speculative ---------------------------------------------------------------------------


@dataclass
class _CycleState:
    """What one cycle hands the next, all on the device."""

    n: mx.array  # int32: tokens in the trunk cache (the position the verify starts at)
    head_n: mx.array  # int32: committed pairs in the head cache
    token: mx.array  # (1,) uint32: last committed token, not yet fed to the trunk
    pending_h: mx.array  # (1, K+1, H): hiddens of the PENDING pairs (first `count` valid)
    pending_tokens: mx.array  # (K+1,) uint32: the token of each PENDING pair
    count: mx.array  # int32: valid PENDING rows
    counts: mx.array  # (V,) float32 output-token counts (penalties)
    seen: mx.array  # (V,) float32 prompt+output tokens seen (penalties)
    trunk_kv: list[mx.array]
    head_kv: list[mx.array]
    # A hybrid trunk's Gated DeltaNet layers, in layer order: [conv0, state0, conv1, ...].
    gdn: list[mx.array] = field(default_factory=list)

    SMALL = 8  # the fields before the KV buffers in flat()

    def flat(self) -> list[mx.array]:
        return [self.n, self.head_n, self.token, self.pending_h, self.pending_tokens,
                self.count, self.counts, self.seen, *self.trunk_kv, *self.gdn, *self.head_kv]

    @classmethod
    def unflat(cls, arrays: list[mx.array], trunk_entries: int, gdn_entries: int = 0) -> "_CycleState":
        kv_end = cls.SMALL + 2 * trunk_entries
        gdn_end = kv_end + 2 * gdn_entries
        return cls(*arrays[:cls.SMALL], trunk_kv=list(arrays[cls.SMALL:kv_end]),
                   head_kv=list(arrays[gdn_end:]), gdn=list(arrays[kv_end:gdn_end]))


class _Launched(NamedTuple):
    """A cycle handed to the device: its committed tokens (K+1, padded), their count, and
    the state it leaves for the next cycle (all lazy)."""

    tokens: mx.array
    count: mx.array
    state: _CycleState


class FusedSpeculativeDecoder:
    """SpeculativeDecoder's contract (cycles(), stats, head_cache, pending_hidden) with each
    cycle one compiled device graph, read back one cycle late."""

    def __init__(self, trunk: Trunk, head: MTPHead, cache: list[Any], params: SamplingParams,
                 history: TokenHistory, seed: int, depth: int,
                 head_cache: list[Any] | None = None) -> None:
        self.trunk, self.head, self.cache = trunk, head, cache
        self.params, self.history, self.seed, self.depth = params, history, seed, depth
        self.head_cache = head_cache if head_cache is not None else head.make_cache()
        self.pending_hidden: mx.array | None = None
        self.stats = AcceptanceStats(depth)
        self.split = CycleSplit()  # armed by the flight recorder's samples (split.py)
        self.layout = cache_layout(cache)  # which trunk layers are attention, which GDN
        route_static_cache_attention()
        self._cycle = compiled_graph(trunk, ("mtp", depth, graph_key(params)),
                                lambda: _speculative_cycle(trunk, head, params, depth, self.layout))

    @small_m_qmm.routed_as_cycles
    def cycles(self, prompt_hiddens: list[mx.array], prompt_ids: list[int],
               first_token: int, *, pending_from: int = 0) -> Iterator[list[int]]:
        """Yield each cycle's committed tokens, forever (see SpeculativeDecoder.cycles).

        On close the trunk `cache` list, `head_cache` and `pending_hidden` hold exactly the
        committed state, as the stepwise decoder leaves them.

        Each cycle runs as an MTP cycle (small_m_qmm.routed_as_cycles: a dense model's
        quantized layers route row-invariantly there).
        """
        K = self.depth
        state, capacity = self._initial_state(prompt_hiddens, prompt_ids, first_token,
                                              pending_from)
        seed = seed_words(self.seed)
        known_n = len(prompt_ids)  # trunk length after the last cycle read back
        # The buffers never grow past what this request was priced for (prompt + max output).
        reach = max(reach_for(known_n + self.params.max_tokens, K), capacity)
        committed = state  # the last read cycle's state (scalars; its buffers move on)
        launched = self._launch(state, seed)
        try:
            while True:
                # The cycle after next writes at most 2(K+1) slots past the last read length.
                if known_n + 2 * (K + 1) + 1 > capacity:
                    capacity = grown_capacity(known_n, K, reach)
                    _grow(launched.state, capacity)
                if self.split.armed:
                    reading, launched = launched, self._launch_timed(launched, seed)
                else:
                    reading, launched = launched, self._launch(launched.state, seed)
                tokens, count = reading.tokens.tolist(), reading.count.item()
                committed = reading.state  # its KV buffers went to the launched cycle
                known_n += count
                self.stats.record(count - 1, count)
                yield tokens[:count]
        finally:
            # The newest buffers hold every committed row unchanged: later cycles only write
            # at or past the committed lengths.
            self._write_back(committed, launched.state)

    def _launch(self, state: _CycleState, seed: mx.array) -> "_Launched":
        """Hand one cycle to the device. It takes `state`'s KV buffers: with no other
        reference left, the cycle's cache writes can reuse them in place instead of
        holding a second copy of the cache."""
        arrays = self._cycle(seed, *state.flat())
        following = self._unflat(arrays[2:])
        state.trunk_kv, state.head_kv = [], []  # a GDN state stays: write-back may need it
        tokens, count = arrays[0], arrays[1]
        mx.async_eval(tokens, count)
        return _Launched(tokens, count, following)

    def _launch_timed(self, previous: "_Launched", seed: mx.array) -> "_Launched":
        """`_launch` as two compiled halves with a sync after each, timed (split.py says why
        only sampled cycles run so). The previous cycle is finished first, so the device
        starts idle; each half's time is its evaluation (calling a compiled function only
        replays its graph, bar the first call, which traces it and is left out)."""
        K, key = self.depth, graph_key(self.params)
        draft = compiled_graph(self.trunk, ("mtp-draft", K, key),
                          lambda: _cycle_halves(self.trunk, self.head, self.params, K, self.layout)[0])
        verify = compiled_graph(self.trunk, ("mtp-verify", K, key),
                           lambda: _cycle_halves(self.trunk, self.head, self.params, K, self.layout)[1])
        state = previous.state
        evaluated_at(previous.tokens, previous.count, state.flat())
        drafted = draft(seed, *state.flat())
        start = time.perf_counter()
        drafted_at = evaluated_at(drafted)
        arrays = verify(seed, *drafted, *state.flat())
        state.trunk_kv, state.head_kv = [], []  # as _launch: the cycle may reuse them in place
        verify_start = time.perf_counter()
        verified_at = evaluated_at(arrays)
        self.split.record(drafted_at - start, verified_at - verify_start)
        return _Launched(arrays[0], arrays[1], self._unflat(arrays[2:]))

    def _unflat(self, arrays: Sequence[mx.array]) -> _CycleState:
        """A compiled cycle's state outputs as a _CycleState of this trunk's layout."""
        return _CycleState.unflat(list(arrays), self.layout.count("kv"), self.layout.count("gdn"))

    def _initial_state(self, prompt_hiddens, prompt_ids, first_token, pending_from):
        """Feed the head every PENDING pair but the last (stepwise, in prefill chunks); the
        last pair becomes the first cycle's one-row PENDING."""
        K = self.depth
        n = len(prompt_ids)
        last_h = feed_pending_pairs(self.trunk, self.head, self.head_cache, prompt_hiddens,
                                    prompt_ids, first_token, pending_from)
        capacity = capacity_for(n + 2 * (K + 1) + 1)
        head_kv = (to_buffers(self.head_cache, capacity) if self.head_cache[0].keys is not None
                   else empty_head_buffers(self.trunk, self.head, capacity))
        pad = mx.zeros((1, K, last_h.shape[-1]), last_h.dtype)
        state = _CycleState(
            n=mx.array(n, mx.int32), head_n=mx.array(self.head_cache[0].offset, mx.int32),
            token=mx.array([first_token], mx.uint32),
            pending_h=mx.concatenate([last_h, pad], axis=1),
            pending_tokens=mx.array([first_token] + [0] * K, mx.uint32),
            count=mx.array(1, mx.int32), counts=self.history.counts, seen=self.history.seen,
            trunk_kv=to_buffers(self._entries("kv"), capacity), head_kv=head_kv,
            gdn=[array for entry in self._entries("gdn") for array in entry.cache])
        # The buffers are copies: drop the prefill's caches (write-back refills the lists).
        self.cache.clear()
        self.head_cache.clear()
        return state, capacity

    def _entries(self, kind: str) -> list[Any]:
        """The trunk cache's entries of one kind ("kv" or "gdn"), in layer order."""
        return entries_of(self.cache, self.layout, kind)

    def _write_back(self, state: _CycleState, newest: _CycleState) -> None:
        """Hand back ordinary caches holding the committed `state` (session bank, callers),
        over the KV buffers of the `newest` launched state."""
        n, head_n, count = state.n.item(), state.head_n.item(), state.count.item()
        # The GDN layers take the committed state's arrays: later cycles' are not committed.
        self.cache[:] = in_layer_order(self.layout, to_kv_caches(newest.trunk_kv, n), gdn_caches(state.gdn))
        self.head_cache[:] = to_kv_caches(newest.head_kv, head_n)
        self.pending_hidden = state.pending_h[:, :count]
        self.history.counts, self.history.seen = state.counts, state.seen


def _grow(state: _CycleState, capacity: int) -> None:
    """Give the state's KV buffers free slots up to `capacity` (in place)."""
    state.trunk_kv = grow_buffers(state.trunk_kv, capacity)
    state.head_kv = grow_buffers(state.head_kv, capacity)


def _speculative_cycle(trunk: Trunk, head: MTPHead, params: SamplingParams,
                       K: int, layout: tuple[str, ...] | None = None) -> Callable:
    """The function compiled for one cycle at depth K (see speculative.py for the rules):
    (seed, *state) -> (committed tokens (K+1,), their count, *next state). `layout`: the
    trunk cache's kinds (cache_layout); None: every layer attention."""

    def cycle(seed: mx.array, *arrays: mx.array) -> tuple[mx.array, ...]:
        s = _state_of(arrays, layout)
        noise = None if params.greedy else _cycle_noise(seed, s, K, s.counts.shape[0])
        head_cache, drafts, q_weights = _draft(trunk, head, params, K, s,
                                               None if noise is None else noise.drafts)
        return _verify(trunk, params, K, s, noise, drafts, q_weights, buffers_of(head_cache), layout)

    return cycle


def _state_of(arrays: tuple[mx.array, ...], layout: tuple[str, ...] | None = None) -> _CycleState:
    """A compiled function's state arguments as a _CycleState (the head's KV: 2 arrays;
    `layout` says how many GDN states there are, None none)."""
    gdn_entries = layout.count("gdn") if layout else 0
    kv_arrays = len(arrays) - _CycleState.SMALL - 2 - 2 * gdn_entries
    return _CycleState.unflat(list(arrays), kv_arrays // 2, gdn_entries)


def _cycle_halves(trunk: Trunk, head: MTPHead, params: SamplingParams,
                  K: int, layout: tuple[str, ...] | None = None) -> tuple[Callable, Callable]:
    """The cycle as two functions for a timed cycle (FusedSpeculativeDecoder._launch_timed):
    draft (seed, *state) -> (drafts, [q-weights when sampling,] *head KV), and verify
    (seed, *draft's outputs, *state) -> the cycle's outputs. Together they compute what
    `_speculative_cycle` does (the verify half draws the same keyed noise again)."""
    drafted_count = (1 if params.greedy else 2) + 2  # drafts [, q-weights], head keys, values

    def noise_of(seed: mx.array, s: _CycleState) -> "_CycleNoise | None":
        return None if params.greedy else _cycle_noise(seed, s, K, s.counts.shape[0])

    def draft(seed: mx.array, *arrays: mx.array) -> tuple[mx.array, ...]:
        s = _state_of(arrays, layout)
        noise = noise_of(seed, s)
        head_cache, drafts, q_weights = _draft(trunk, head, params, K, s,
                                               None if noise is None else noise.drafts)
        return (drafts, *([] if q_weights is None else [q_weights]), *buffers_of(head_cache))

    def verify(seed: mx.array, *arrays: mx.array) -> tuple[mx.array, ...]:
        drafted, s = arrays[:drafted_count], _state_of(arrays[drafted_count:], layout)
        q_weights = None if params.greedy else drafted[1]
        return _verify(trunk, params, K, s, noise_of(seed, s), drafted[0], q_weights,
                       list(drafted[-2:]), layout)

    return draft, verify


def _verify(trunk: Trunk, params: SamplingParams, K: int, s: _CycleState,
            noise: "_CycleNoise | None", drafts: mx.array, q_weights: mx.array | None,
            head_kv: list[mx.array], layout: tuple[str, ...] | None = None) -> tuple[mx.array, ...]:
    """The cycle after its drafts: the verify forward, the accept rule and the next state,
    as (committed tokens (K+1,), their count, *next state). A GDN layer keeps the state
    after the committed rows (fused_gdn.py)."""
    caches = trunk_caches(s, layout or ("kv",) * (len(s.trunk_kv) // 2))
    hidden = trunk.text.model(mx.concatenate([s.token, drafts])[None], caches)
    accepted, targets = _accept(trunk, params, K, s, noise, hidden, drafts, q_weights)
    rows = mx.arange(K + 1)
    correction = mx.take(targets, accepted.reshape(1))
    committed = mx.where(rows < accepted, mx.concatenate([drafts, correction]),
                         mx.where(rows == accepted, correction, mx.zeros_like(correction)))
    count = (accepted + 1).astype(mx.int32)
    counts, seen = s.counts, s.seen
    if params.has_penalties:
        gained = mx.sum(one_hot(committed, counts.shape[0]) * (rows <= accepted)[:, None], axis=0)
        counts, seen = counts + gained, seen + gained
    nxt = _CycleState(
        n=s.n + count, head_n=s.head_n + s.count, token=correction, pending_h=hidden,
        pending_tokens=committed, count=count, counts=counts, seen=seen,
        trunk_kv=buffers_of([c for c in caches if isinstance(c, StaticKVCache)]), head_kv=head_kv,
        gdn=[array for c in caches if isinstance(c, FusedGDNCache) for array in c.committed(count)])
    return (committed, count, *nxt.flat())


def _draft(trunk: Trunk, head: MTPHead, params: SamplingParams, K: int, s: _CycleState,
           draft_noise: mx.array | None) -> tuple[list[StaticKVCache], mx.array, mx.array | None]:
    """The head over PENDING, then K chained drafts: (head cache, drafts (K,), and when
    sampling the drafts' log-weights (K, V), q = their softmax)."""
    # PENDING: K+1 rows written at head_n, of which the first `count` are real pairs.
    head_cache = static_caches(s.head_kv, s.head_n)
    g = head(s.pending_h, trunk.embed(s.pending_tokens[None]), head_cache)
    g = mx.take(g, (s.count - 1).reshape(1), axis=1)
    # the chained steps overwrite the invalid rows; each offset held as static_caches holds it
    head_cache[0].offset = buffer_attention.in_device_memory(s.head_n + s.count)
    drafts, q_weights = [], []
    counts, seen = s.counts[None], s.seen[None]
    for i in range(K):
        logits = apply_penalties(trunk.draft_logits(g)[0], params, counts, seen)
        if params.greedy:
            d = mx.argmax(logits, axis=-1)
        else:  # Gumbel-max: argmax(w + Gumbel noise) is a draw from softmax(w)
            weights = draft_weights(logits, params)
            d = mx.argmax(weights + draft_noise[i], axis=-1)
            q_weights.append(weights[0])
        drafts.append(d[0].astype(mx.uint32))
        if params.has_penalties:
            onehot = one_hot(d, counts.shape[-1])
            counts, seen = counts + onehot, seen + onehot
        if i + 1 < K:
            g = head(g, trunk.embed(d[None]), head_cache)
            head_cache[0].offset = buffer_attention.in_device_memory(head_cache[0].offset + 1)
    return head_cache, mx.stack(drafts), mx.stack(q_weights) if q_weights else None


class _CycleNoise(NamedTuple):
    """A sampled cycle's randomness."""

    drafts: mx.array  # (K, V) Gumbel noise, one row per draft
    fallback: mx.array  # (K+1, V) Gumbel noise, one row per possible first rejection, bonus last
    accept: mx.array  # (K,) uniforms in [0, 1), one per acceptance test


def _cycle_noise(seed: mx.array, s: _CycleState, K: int, vocab_size: int) -> _CycleNoise:
    """All of a sampled cycle's random numbers from one key and one draw.

    Why one draw: on a GPU each random draw is its own kernels, and a cycle used 2K+2 of
    them. The numbers are independent of each other and of everything the cycle computes,
    which is all exactness asks. Keyed by the cycle's absolute start position, so a seeded
    request replays the same output.
    """
    key = device_position_keys(seed, (s.n + 1).reshape(1), CYCLE).reshape(2)  # a view, no gather
    uniform = mx.random.uniform(shape=(2 * K + 2, vocab_size), key=key)
    gumbel = -mx.log(-mx.log(uniform[:2 * K + 1]))  # as mx.random.gumbel
    return _CycleNoise(gumbel[:K], gumbel[K:], uniform[2 * K + 1, :K])


def _accept(trunk: Trunk, params: SamplingParams, K: int, s: _CycleState, noise: _CycleNoise | None,
            hidden: mx.array, drafts: mx.array,
            q_weights: mx.array | None) -> tuple[mx.array, mx.array]:
    """(accepted drafts, the token to emit at each possible first rejection, bonus last)."""
    logits = trunk.lm_head(hidden)[0]
    counts, seen = history_rows(s.counts, s.seen, drafts, K + 1)  # row i counts d_1..d_i too
    penalised = apply_penalties(logits, params, counts, seen)
    if params.greedy:
        targets = mx.argmax(penalised, axis=-1).astype(mx.uint32)
        accept = drafts == targets[:K]
    else:
        p = mx.softmax(scaled_logits(penalised, params), axis=-1)
        q = mx.softmax(q_weights, axis=-1)
        rows = mx.arange(K)
        accept = noise.accept < acceptance_probability(p[rows, drafts], q[rows, drafts])
        fallback = mx.concatenate([residual_distribution(p[:K], q), p[K:]], axis=0)
        targets = mx.argmax(log_weights(fallback) + noise.fallback, axis=-1).astype(mx.uint32)
    return mx.sum(mx.cumprod(accept.astype(mx.int32))), targets
