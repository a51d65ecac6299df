"""Causal attention of a long prefill chunk on the CPU backend, block-wise in numpy.

Why: MLX 0.32's CPU `mx.fast.scaled_dot_product_attention` is unfused (a (heads, chunk,
prefix) score matrix, a `where` for the mask, a softmax, a matmul) and its softmax `exp` is
scalar (libm `fmaf` calls, about 20 ns an element; MLX's x86 build has no SIMD), two thirds
of a long prefill's time (docs/benchmarks.md, "What limits a long prefill on this CPU").
numpy's float32 `exp` is SIMD (about 1.3 ns an element) and its matmuls run on its own
OpenBLAS, so here the chunk's attention is computed flash-style: for each KV head (its GQA
query heads stacked as one matrix) and block of query rows, over blocks of keys, with an
online softmax, so each score block stays in cache and is passed over a few times only.

Only long prefill chunks come here (`takes`): at least PREFILL_MIN_QUERIES queries over at
least PREFILL_MIN_KEYS keys with mlx-lm's "causal" mask, a plain float cache and no sinks.
Decode steps, verifies, drafts, cohort forwards and short prompts keep MLX's own attention,
and both the AR and the speculative path prefill through the same chunks, so greedy MTP
still equals greedy AR token for token (the chunks round as numpy does, for both).

`MTPLX_CPU_ATTENTION` (the config key `cpu_attention`) picks the path: `auto` (this one on
the CPU backend), `numpy` (the same), or `mlx` (MLX's own attention everywhere).
"""

from __future__ import annotations

import ctypes
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm.models.qwen3 as mlx_lm_qwen3
import mlx_lm.models.qwen3_moe as mlx_lm_qwen3_moe
import mlx_lm.models.qwen3_next as mlx_lm_qwen3_next
import numpy as np
from mlx_lm.models.base import scaled_dot_product_attention as mlx_lm_attention

PREFILL_MIN_QUERIES = 64   # fewer query rows are decode, verify or draft steps: MLX's path
PREFILL_MIN_KEYS = 256     # shorter prompts keep MLX's numerics: milliseconds to gain there
QUERY_BLOCK = 128          # query rows per block (times the GQA group: the score block's rows)
KEY_BLOCK = 1024           # keys per block: a 256 x 1024 float32 score block is 1 MiB (in L2)
MODES = ("auto", "numpy", "mlx")

log = logging.getLogger(__name__)

_mode = os.environ.get("MTPLX_CPU_ATTENTION", "auto")
if _mode not in MODES:  # the daemon refuses such a value in its config; the engine alone
    log.warning("MTPLX_CPU_ATTENTION=%r is not one of %s; using auto", _mode, ", ".join(MODES))
    _mode = "auto"
_pool: ThreadPoolExecutor | None = None


def set_mode(mode: str) -> None:
    """Pick the CPU prefill attention: "auto"/"numpy" (this module's) or "mlx" (MLX's)."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"cpu_attention must be one of {', '.join(MODES)}, got {mode!r}")
    _mode = mode


def current_mode() -> str:
    """The mode set now: "auto", "numpy" or "mlx"."""
    return _mode


def enabled() -> bool:
    """True when long prefill chunks take the numpy path (the CPU backend, not switched off)."""
    return _mode != "mlx" and mx.default_device() == mx.cpu


def path_name() -> str:
    """What runs a long prefill chunk's attention here (`ModelInfo.kernels`)."""
    return "numpy block-wise (long prefill)" if enabled() else "mlx scaled_dot_product_attention"


def takes(queries: mx.array, keys: mx.array, cache: Any, mask: Any, sinks: Any) -> bool:
    """True for a call this module computes: a long causal prefill chunk over a float cache."""
    return (enabled() and isinstance(mask, str) and mask == "causal" and sinks is None
            and not hasattr(cache, "bits") and queries.shape[0] == 1
            and queries.shape[2] >= PREFILL_MIN_QUERIES and keys.shape[2] >= PREFILL_MIN_KEYS
            and keys.shape[2] >= queries.shape[2] and queries.shape[1] % keys.shape[1] == 0)


def attention(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float,
              mask: Any, sinks: mx.array | None = None) -> mx.array:
    """mlx-lm's `scaled_dot_product_attention` (same arguments), with long causal prefill
    chunks on the CPU computed by `causal_attention`."""
    if takes(queries, keys, cache, mask, sinks):
        return causal_attention(queries, keys, values, scale)
    return mlx_lm_attention(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def route_model_attention() -> None:
    """Make mlx-lm's qwen3 family layers (dense, MoE, and qwen3_next, whose attention
    qwen3_5 shares) call `attention`.

    mlx-lm's Attention calls its module's `scaled_dot_product_attention` and offers no other
    hook. A module already routed elsewhere is left alone: fused.py's `static_cache_attention`
    (qwen3) falls back to `attention` itself, so each call meets one dispatch, in any order
    of installation.
    """
    for module in (mlx_lm_qwen3, mlx_lm_qwen3_moe, mlx_lm_qwen3_next):
        if module.scaled_dot_product_attention is mlx_lm_attention:
            module.scaled_dot_product_attention = attention


def causal_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
    """softmax(q k^T * scale + causal) v for (1, Hq, L, D) queries over (1, Hkv, S, D) keys and
    values, query row i seeing keys 0..S-L+i (mlx's "causal" mask after S-L cached tokens).

    Evaluates its inputs (a sync point in the lazy graph); computes in float32 and returns
    the queries' dtype, as MLX's attention does.
    """
    q, k, v = (_as_float32(a)[0] for a in (queries, keys, values))
    heads, kv_heads = q.shape[0], k.shape[0]
    group = heads // kv_heads
    out = np.empty_like(q)
    jobs = [(h, start) for h in range(kv_heads) for start in range(0, q.shape[1], QUERY_BLOCK)]

    def run(job: tuple[int, int]) -> None:
        h, start = job
        heads_of_h = slice(h * group, (h + 1) * group)
        block = _query_block(q[heads_of_h], k[h], v[h], start, np.float32(scale))
        out[heads_of_h, start:start + QUERY_BLOCK] = block

    list(_thread_pool().map(run, jobs))
    return mx.array(out[None]).astype(queries.dtype)


def _query_block(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int,
                 scale: np.float32) -> np.ndarray:
    """Attention of query rows [start, start+QUERY_BLOCK) of a GQA group's (G, L, D) queries
    over one KV head's (S, D) keys and values; returns (G, rows, D).

    The group's heads are stacked into one (G*rows, D) matrix so each key block is one
    matmul. Keys are walked in KEY_BLOCK blocks with an online softmax (running max and
    sum per row, the accumulator rescaled when the max grows).
    """
    group, length, dim = q.shape
    rows = min(QUERY_BLOCK, length - start)
    first_pos = k.shape[0] - length + start  # absolute position of the block's first query
    stacked = (q[:, start:start + rows] * scale).reshape(group * rows, dim)
    positions = np.tile(np.arange(first_pos, first_pos + rows), group)[:, None]
    visible = first_pos + rows  # keys this block's last row may see
    run_max = np.full((group * rows, 1), -np.inf, np.float32)
    run_sum = np.zeros((group * rows, 1), np.float32)
    acc = np.zeros((group * rows, dim), np.float32)
    for key_start in range(0, visible, KEY_BLOCK):
        key_stop = min(key_start + KEY_BLOCK, visible)
        scores = stacked @ k[key_start:key_stop].T
        if key_stop > first_pos + 1:  # the block reaches past the first row's own position
            hidden = np.arange(key_start, key_stop)[None] > positions
            scores[hidden] = -np.inf
        new_max = np.maximum(run_max, scores.max(axis=1, keepdims=True))
        rescale = np.exp(run_max - new_max)
        scores -= new_max
        np.exp(scores, out=scores)
        run_sum = run_sum * rescale + scores.sum(axis=1, keepdims=True)
        acc *= rescale
        acc += scores @ v[key_start:key_stop]
        run_max = new_max
    return (acc / run_sum).reshape(group, rows, dim)


def _as_float32(array: mx.array) -> np.ndarray:
    """A float32 numpy view of an MLX array, evaluated (numpy has no bfloat16: other dtypes
    are converted first). A view, not a copy: a long prefix's keys are tens of MB a layer."""
    return np.asarray(array.astype(mx.float32))


def _thread_pool() -> ThreadPoolExecutor:
    """Workers for the (KV head, query block) jobs: numpy releases the GIL in its matmuls
    and ufuncs, so the jobs run on every core. Each worker's matmuls run on that worker
    alone (`_one_blas_thread`)."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, initializer=_one_blas_thread,
                                   thread_name_prefix="mtplx-cpu-attention")
    return _pool


def _one_blas_thread() -> None:
    """Make numpy's OpenBLAS compute this thread's matmuls in this thread.

    Why: numpy bundles its own OpenBLAS, beside the one MLX's matmuls run on (mtplxd.blas).
    Each keeps a thread pool whose threads spin for a while after every call; with both
    threaded, their spinning threads took the cores from each other's work and a 1k-token
    prefill cost twice MLX's CPU time. The jobs are split across our workers instead.
    `openblas_set_num_threads_local` (OpenBLAS 0.3.27+) sets it for the calling thread only.
    """
    for library in sorted((Path(np.__file__).parent.parent / "numpy.libs").glob("*openblas*")):
        try:
            ctypes.CDLL(str(library)).openblas_set_num_threads_local(1)
        except (OSError, AttributeError):
            continue
        return
