"""The compiled AR loop (decoding/fused_ar.py) timed greedy on any model it takes: a bench
arm beside the op-by-op loop (issue 22, point 6).

Why: at Qwen3-32B dims on the H200 MLX's decode step took 19-21 ms whatever the bytes it
read, and the hybrid 27B's step is host-bound (host time = wall time). Replaying one traced
graph a token costs the host less than building it op by op; whether that wins depends on
the model (the hybrid 27B: 17.9-18.1 ms compiled against 23.2-24.7; the 32B: 24.3 against
20.0, its exact-length attention being faster than a step over fixed buffers). Served, the
compiled loop runs for hybrids on CUDA (fused_ar.fused_ar_wanted); here it runs for any
model whose cache the fused loops take, so `real_size` reports both for every size.
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx

from mtplxd.engine.decoding.fused import fused_supported
from mtplxd.engine.decoding.fused_ar import fused_ar_cycles
from mtplxd.engine.decoding.sampling import TokenHistory
from mtplxd.engine.interface import SamplingParams


def compiled_ar_supported(trunk: Any) -> bool:
    """Whether the compiled loop takes this trunk's cache: attention KV, and for a hybrid its
    Gated DeltaNet layers (the fused loops' domain)."""
    return fused_supported(trunk, trunk.make_cache(), hybrid=True)


def compiled_greedy_decode(trunk: Any, prompt: list[int], tokens: int) -> tuple[list[int], float]:
    """(the `tokens` greedy tokens after `prompt`, wall ms per token): the prompt prefilled
    as served, then the compiled loop. The first two tokens after the prefill's (the trace
    and the first replay) are left out of the time."""
    cache = trunk.make_cache()
    _, logits = trunk.prefill(prompt, cache)
    first = int(mx.argmax(logits, axis=-1).item())
    params = SamplingParams(temperature=0.0, max_tokens=tokens)
    loop = fused_ar_cycles(trunk, cache, params, TokenHistory(logits.shape[-1], prompt), 0, first, len(prompt))
    out, started = [first], None
    while len(out) < tokens:
        out += next(loop)
        if len(out) == 3:
            started = time.perf_counter()
    loop.close()
    timed = len(out) - 3
    ms = (time.perf_counter() - started) * 1000 / timed if started is not None and timed > 0 else 0.0
    return out, ms
