"""A greedy AR decode step as one compiled graph over fixed-capacity KV buffers: a bench arm
that asks whether the served AR step is bound by the host (issue 22, point 6).

Why: at Qwen3-32B dims on the H200 MLX's decode step takes 19-21 ms whatever the bytes it
reads (bf16, 8-bit and 4-bit alike), while a compiled depth-1 MTP cycle, which verifies two
tokens and drafts one, took 19.9 ms (docs/benchmarks.md, "The 32B with the tensor-core
layout"). The served AR step (decoding/autoregressive.py) builds its graph op by op in
Python every token over an exact-length cache; here the fused cycles' machinery
(decoding/fused.py: StaticKVCache, buffer attention on CUDA) serves one token a step, traced
once and replayed. If this step is much faster than ours at a real size, the AR loop is
host-bound and should be compiled too; fused.py's docstring has why it is not today (on the
embedded model the exact-length attention was faster).

A hybrid (Qwen3.5/3.6) runs the same step: its Gated DeltaNet layers' conv window and
recurrent state have one shape whatever the context, so they go in and out of the graph
beside the KV buffers. The hybrid 27B's decode is the host-bound one on the H200 (3,741
primitives a 4-bit step, host time 22.8 of 22.8 ms wall, docs/benchmarks.md).

Greedy only: the arm measures the step's cost, and its tokens must equal our AR loop's
(tested on the CPU backend).
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx

from mtplxd.engine.decoding.fused import (
    buffers_of, cache_layout, capacity_for, entries_of, fused_supported, gdn_caches, in_layer_order,
    route_static_cache_attention, static_caches, to_buffers,
)


def compiled_ar_supported(trunk: Any) -> bool:
    """Whether the step takes this trunk's cache: attention KV, and for a hybrid its Gated
    DeltaNet layers (the fused loops' domain)."""
    return fused_supported(trunk, trunk.make_cache(), hybrid=True)


def _step(trunk: Any, layout: tuple[str, ...]):
    """step(token (1,), n, *kv buffers, *gdn arrays) -> (next token (1,), n + 1, *the same,
    written). `layout` is the trunk cache's kinds in layer order ("kv", "gdn"); a Gated
    DeltaNet layer's state is its conv window and recurrent state, fixed in shape."""
    kv_arrays = 2 * layout.count("kv")

    def step(token: mx.array, n: mx.array, *arrays: mx.array) -> tuple[mx.array, ...]:
        attention = static_caches(list(arrays[:kv_arrays]), n)
        recurrent = gdn_caches(list(arrays[kv_arrays:]))
        hidden = trunk.text.model(token.reshape(1, 1), in_layer_order(layout, attention, recurrent))
        chosen = mx.argmax(trunk.lm_head(hidden)[0, -1], axis=-1).astype(mx.uint32).reshape(1)
        states = [array for entry in recurrent for array in entry.cache]
        return (chosen, n + 1, *buffers_of(attention), *states)

    return step


def compiled_greedy_decode(trunk: Any, prompt: list[int], tokens: int) -> tuple[list[int], float]:
    """(the `tokens` greedy tokens after `prompt`, wall ms per token): the prompt prefilled
    as served, then one compiled step per token, pipelined one step ahead as our AR loop is.
    The first two steps (the trace) are left out of the time."""
    route_static_cache_attention()
    cache = trunk.make_cache()
    _, logits = trunk.prefill(prompt, cache)
    first = mx.argmax(logits, axis=-1).astype(mx.uint32).reshape(1)
    layout = cache_layout(cache)
    recurrent = [array for entry in entries_of(cache, layout, "gdn") for array in entry.cache]
    buffers = to_buffers(entries_of(cache, layout, "kv"), capacity_for(len(prompt) + tokens + 2))
    step = mx.compile(_step(trunk, layout))
    state = step(first, mx.array(len(prompt), mx.int32), *buffers, *recurrent)
    mx.async_eval(list(state))
    out = [int(first.item())]
    started = None
    while len(out) < tokens:
        following = step(*state)
        mx.async_eval(list(following))
        out.append(int(state[0].item()))
        if len(out) == 3:  # the trace and the first replay are behind us
            started = time.perf_counter()
        state = following
    timed = len(out) - 3
    ms = (time.perf_counter() - started) * 1000 / timed if started is not None and timed > 0 else 0.0
    return out, ms
