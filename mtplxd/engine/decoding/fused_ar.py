"""Plain autoregressive decoding with each token one compiled device graph: the AR loop
on CUDA for hybrid models, and for dense ones whose decode steps take the small-M kernel
on prompts of up to DENSE_PROMPT_TOKENS.

Why: the hybrid 27B's AR step is host-bound on the H200. The host builds about 3,200
primitives a token op by op (4,500 without the GDN decode kernel), and the device waits on
it (docs/benchmarks.md, "The GDN decode-step kernel on the H200": wait 0.01 ms a step). Traced
once and replayed, the same step took 17.9-18.1 ms against the op-by-op loop's 23.2-24.7 in
the same processes. A dense model's step with MLX's matmuls went the other way (the 32B
4-bit on an H100, 2026-12-06: 22.6-23.2 ms compiled against 20.3 op by op; 8-bit 20.3
against 17.7), so those keep autoregressive.py's loop. With the small-M kernel on its
decode steps (`small_m_qmm.decode_routed`: a dense 4-bit 32B) the op-by-op step builds
about 2,600 primitives and 190 custom kernels a token, and its time swung between
processes (25.5-28.3 ms in three, 16.0 in one); this loop took 16.2-17.1 ms in four
processes, and a compiled step 15.9-16.1 ms in each of the four op-by-op ones
(docs/benchmarks.md, "The 32B's AR step compiled, and the KV write that read the whole
buffer"), so that model decodes here, for prompts of up to DENSE_PROMPT_TOKENS (below). Every
model off CUDA keeps the op-by-op loop unless forced.

The step is the fused cycles' machinery at one token (fused.py): attention KV in
fixed-capacity buffers with the length as a device scalar, a GDN layer's conv window and
recurrent state in and out of the graph, and the AR sampler chain (`sampling.row_sampler`)
inside it, with the penalty history carried as arrays. It picks what autoregressive.ar_step
picks from the same logits (same sampler, same position keys), so on the CPU backend its
tokens are the op-by-op loop's, greedy and seeded. Pipelined the same way: token t+1's
step is handed to the device before token t is read back.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterator

import mlx.core as mx

from mtplxd.engine.decoding.fused import (
    buffers_of, cache_layout, capacity_for, compiled_graph, entries_of, fused_supported, gdn_caches,
    grow_buffers, grown_capacity, in_layer_order, reach_for, route_static_cache_attention,
    static_caches, to_buffers, to_kv_caches,
)
from mtplxd.engine.decoding.sampling import TokenHistory, graph_key, one_hot, row_sampler, seed_words
from mtplxd.engine.interface import SamplingParams
from mtplxd.engine.model.trunk import Trunk

_forced: bool | None = None
# The longest prompt for which a dense model whose decode steps take the small-M kernel's
# vector layout decodes AR in this loop; longer ones keep the op-by-op loop, whose cuDNN
# attention grows slowly with the context. This loop's attention is the buffer kernel
# (buffer_attention.py), in parts by KV head from 2,048 slots (split then; the mma form since
# 2026-12-07). On an H100 (the 32B 4-bit at 8,192 tokens, one process, 2026-12-06, eighth
# session) this loop took 14.9-15.1 ms a token with the split form, where the op-by-op loop
# took 16.2-30.6 (seven figures: its host-bound steps swing between rounds) and this loop with
# the one-pass kernel 23.2-23.3 (docs/benchmarks.md, "The offset in device memory"); below
# 2,048 slots the one-pass kernel's layer costs less than the split form's at 8,192 tokens.
# Past 8,192 tokens it is untimed. A dense model routed row-invariantly has no such limit
# (`fused_ar_wanted`).
DENSE_PROMPT_TOKENS = 8192


def fused_ar_wanted(trunk: Trunk, cache: list[Any], prompt_tokens: int = 0) -> bool:
    """Whether an AR request of `prompt_tokens` on `trunk` decodes in this loop: on CUDA,
    where the fused loops run (`decode_loop` "fused"), a hybrid (Gated DeltaNet layers in its
    cache), a model routed row-invariantly (a 27B/32B-class dense 8-bit one by default, any with
    `MTPLX_ROW_INVARIANT=1`) where the GPU has the kernel's mma layout, or a model whose decode
    steps take the kernel's vector layout (`small_m_qmm.decode_routed`: a dense 4-bit model of
    Qwen3-4B's size or larger) for prompts of at most DENSE_PROMPT_TOKENS (timed at 8,192
    tokens on the 32B 4-bit; the 4B's at 512).
    A row-invariant model takes it at any prompt length, as a hybrid does: its op-by-op steps
    are custom kernels launched one by one, bound by the host (the 32B 8-bit's op by op took
    1.11x the mixed routing's, which took 1.24x this loop's row-invariant step at 512 tokens:
    H100, 2026-12-05 and 2026-12-07), while this loop's attention, the buffer kernel's mma
    form from 2,048 slots, took less than cuDNN's over the keys seen at 8,192 tokens (22 + 6
    us a 32B layer against 30 + 5). Past 8,192 tokens both are untimed.
    `MTPLX_FUSED_AR` "0" turns it off, "1" on for any model the loop takes (benches); `force`
    overrides both."""
    if not fused_supported(trunk, cache, hybrid=True):
        return False
    if _forced is not None:
        return _forced
    setting = os.environ.get("MTPLX_FUSED_AR", "")
    if setting in ("0", "1"):
        return setting == "1"
    from mtplxd.engine.model import small_m_qmm
    from mtplxd.engine.model.kv_cache import fixed_shapes_wanted

    if not (trunk.decode_loop == "fused" and fixed_shapes_wanted()):
        return False
    if "gdn" in cache_layout(cache):
        return True
    # Every product on the mma layout (without it row-invariant routing leaves MLX's matmuls),
    # or the decode steps' large products on the vector layout.
    if small_m_qmm.routed_row_invariant(trunk.model) and small_m_qmm.mma_usable():
        return True
    return prompt_tokens <= DENSE_PROMPT_TOKENS and small_m_qmm.decode_routed(trunk.model)


def path_name(trunk: Trunk) -> str:
    """What /health and status say about an AR request's decode step (`kernels.ar_decode`)."""
    cache = trunk.make_cache()
    if not fused_ar_wanted(trunk, cache):
        return "op by op"
    if fused_ar_wanted(trunk, cache, prompt_tokens=DENSE_PROMPT_TOKENS + 1):
        return "compiled"
    return f"compiled for prompts up to {DENSE_PROMPT_TOKENS:,} tokens, op by op beyond"


def force(value: bool | None) -> None:
    """Override `fused_ar_wanted` (None: back to its rule); for tests and benches."""
    global _forced
    _forced = value


def fused_ar_cycles(trunk: Trunk, cache: list[Any], params: SamplingParams, history: TokenHistory,
                    seed: int, last_token: int, position: int) -> Iterator[list[int]]:
    """autoregressive.ar_cycles' contract, one compiled step a token: yield one committed
    token per step, forever. `last_token` is the committed token at absolute `position`
    (already in `history`, not yet fed), and `position` is the trunk cache's length.

    The loop takes the cache's rows into its buffers; on close `cache` (the list, in place)
    holds ordinary caches over every committed token but the last read one, which is not
    fed, and `history` the penalty counts of every token read back, as the fused MTP loop
    leaves them (the session bank keys a prefix of prompt + output).
    """
    layout = cache_layout(cache)
    route_static_cache_attention()
    step = compiled_graph(trunk, ("ar", graph_key(params)), lambda: _ar_step(trunk, params, layout))
    reach = max(reach_for(position + params.max_tokens, 0), capacity_for(position + 3))
    capacity = capacity_for(position + 3)
    kv_arrays = 2 * layout.count("kv")
    state = [mx.array([last_token], mx.uint32), mx.array([position + 1], mx.uint32),
             mx.array(position, mx.int32), history.counts[None], history.seen[None],
             *to_buffers(entries_of(cache, layout, "kv"), capacity),
             *[array for entry in entries_of(cache, layout, "gdn") for array in entry.cache]]
    cache.clear()  # the buffers are copies: write-back refills the list
    words = seed_words(seed)
    # The state before the step whose token was last read back, without KV buffers (the
    # newest state's hold its rows), and its cache length.
    committed, known_n = [*state[:_KV], *state[_KV + kv_arrays:]], position
    launched, first = state, True
    del state
    try:
        while True:
            if known_n + 3 > capacity:  # the step after next writes at known_n + 1
                capacity = grown_capacity(known_n, 0, reach)
                launched = _with_capacity(launched, capacity, kv_arrays)
            reading, launched = launched, list(step(words, *launched))
            # Its KV buffers are the launched step's now: with no other reference left, MLX
            # writes the new row in place instead of copying the cache every token.
            del reading[_KV:_KV + kv_arrays]
            mx.async_eval(launched[0])
            if first:  # the first step is in flight: nothing to read back yet
                first = False
                continue
            token = reading[0].item()
            committed, known_n = reading, known_n + 1
            yield [token]
    finally:
        _write_back(cache, layout, history, committed, known_n, launched, kv_arrays)


_KV = 5  # a state list: token, position, n, counts, seen, then the KV buffers, then GDN arrays


def _with_capacity(state: list[mx.array], capacity: int, kv_arrays: int) -> list[mx.array]:
    """`state` with its KV buffers grown to `capacity` slots (one retrace of the step)."""
    kv = grow_buffers(state[_KV:_KV + kv_arrays], capacity)
    return [*state[:_KV], *kv, *state[_KV + kv_arrays:]]


def _write_back(cache: list[Any], layout: tuple[str, ...], history: TokenHistory,
                committed: list[mx.array], length: int, newest: list[mx.array], kv_arrays: int) -> None:
    """Refill `cache` with ordinary caches over the committed state: `length` rows of the
    newest KV buffers (later steps only write past them) and the committed GDN state (a
    later step's is a token ahead; `committed` gave its KV buffers away); `history` takes
    the committed penalty counts."""
    kv = newest[_KV:_KV + kv_arrays]
    cache[:] = in_layer_order(layout, to_kv_caches(kv, length), gdn_caches(committed[_KV:]))
    history.counts, history.seen = committed[3][0], committed[4][0]


def _ar_step(trunk: Trunk, params: SamplingParams, layout: tuple[str, ...]) -> Callable:
    """step(seed words, token (1,), position (1,) uint32, n, counts (1, V), seen (1, V), *kv
    buffers, *gdn arrays) -> (the next token, its position + 1, n + 1, counts, seen, *the
    buffers and states written): feed `token` at cache length n, pick the token at
    `position` as autoregressive.ar_pick does."""
    kv_arrays = 2 * layout.count("kv")
    sample = row_sampler(params)

    def step(words: mx.array, token: mx.array, position: mx.array, n: mx.array, counts: mx.array,
             seen: mx.array, *arrays: mx.array) -> tuple[mx.array, ...]:
        attention = static_caches(list(arrays[:kv_arrays]), n)
        recurrent = gdn_caches(list(arrays[kv_arrays:]))
        hidden = trunk.body(token.reshape(1, 1), in_layer_order(layout, attention, recurrent))
        logits = trunk.lm_head(hidden)[:, -1, :]
        chosen, following = sample(logits, counts, seen, words, position)
        if params.has_penalties:
            gained = one_hot(chosen, counts.shape[-1])
            counts, seen = counts + gained, seen + gained
        states = [array for entry in recurrent for array in entry.cache]
        return (chosen, following, n + 1, counts, seen, *buffers_of(attention), *states)

    return step
