"""Scratch comparison for docs/benchmarks.md (issue 21): one prefill chunk's attention on the
Linux CPU through mx.fast.scaled_dot_product_attention against the same attention with exp
computed as power(e, x). Not engine code; run from the repository root:

    PYTHONPATH=$PWD python docs/benchmarks-data/cpu-prefill/power-softmax-scratch.py
"""
import math
import time

import mtplxd.engine  # noqa: F401  (loads OpenBLAS before MLX, as the daemon does)
import mlx.core as mx

E = mx.array(math.e, mx.float32)


def sdpa(q, k, v, mask):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")


def power_attention(q, k, v, mask):
    batch, heads, rows, dim = q.shape
    kv_heads = k.shape[1]
    grouped = (q * 0.125).reshape(batch, kv_heads, (heads // kv_heads) * rows, dim)
    scores = grouped @ k.swapaxes(-1, -2)
    scores = mx.where(mask, scores.reshape(batch, kv_heads, heads // kv_heads, rows, -1), -mx.inf)
    scores = scores.reshape(batch, kv_heads, (heads // kv_heads) * rows, -1)
    weights = mx.power(E, scores - mx.max(scores, axis=-1, keepdims=True))
    out = (weights @ v) / mx.sum(weights, axis=-1, keepdims=True)
    return out.reshape(batch, heads, rows, dim)


rows, keys = 512, 4608
q, k, v = (mx.random.normal(shape) for shape in ((1, 4, rows, 64), (1, 2, keys, 64), (1, 2, keys, 64)))
mask = mx.arange(keys - rows, keys)[:, None] >= mx.arange(keys)[None]
mx.eval(q, k, v, mask)
print("max abs difference", mx.abs(sdpa(q, k, v, mask) - power_attention(q, k, v, mask)).max().item())
times = {"sdpa": [], "power": []}
for _ in range(3):
    for name, attend in (("sdpa", sdpa), ("power", power_attention)):
        cpu, wall = time.process_time(), time.perf_counter()
        mx.eval(attend(q, k, v, mask))
        times[name].append((time.process_time() - cpu, time.perf_counter() - wall))
for name, runs in times.items():
    print(f"{name}: median CPU {sorted(r[0] for r in runs)[1]:.3f} s, wall {sorted(r[1] for r in runs)[1]:.3f} s")
