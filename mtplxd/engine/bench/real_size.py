"""The engine at real model sizes, random weights built in memory, beside stock mlx-lm.

    python -m mtplxd.engine.bench.real_size [--sizes qwen3-4b,qwen3-32b,hybrid-27b]
        [--dtypes bf16,8bit,4bit,f32] [--context 512] [--depths 1,2,3,4,5] [--decode-tokens 48]
        [--cycles 16] [--repeats 10] [--cycle-temperatures 0,0.6] [--small-m-kernel]
        [--small-m-loops] [--decode-vector-values N,...] [--kernel-decode-from N|never]
        [--divergence-tokens N] [--divergence-limit 32] [--prefill-tokens N] [--decode-only]
        [--gdn-chunked] [--row-invariant] [--row-invariant-beside] [--mma-configs 4x4,4x2]
        [--kv-write-beside] [--stacked] [--attention-forms one-pass,two-pass,split,0] [--qk-norm-rope]
        [--json-out FILE]

No download: each model is built from its config with random weights (bf16, then MLX affine
quantization in groups of 64 for 8bit/4bit; `f32` keeps float32, the exactness checks'
control), with a random MTP head, one layer at a time so a 65 GB bf16 32B never needs a
float32 copy. Sizes: `qwen3-4b` and `qwen3-32b` (dense qwen3, the releases' config.json),
`hybrid-27b` (Qwen3.5/3.6-27B: 64 layers, 48 Gated DeltaNet and 16 gated attention, hidden
5120, vocab 248,320), `mid` (7M parameters, for a CPU), `hybrid-27b-layers` (the 27B hybrid's
64 layers at the tiny widths: a 27B step's graph, whose host cost a CPU can measure) and
`tiny` / `tiny-hybrid` for tests. For each size and dtype, at `--context` tokens of context:

  * decode: ms per token of our AR loop and of mlx-lm's `generate_step` (the reference line)
    over `--decode-tokens` tokens, greedy and T=0.6 top-p 0.95; `roofline_ms` = bytes read
    per decode step / 4.3 TB/s (the H200's copy bandwidth), where the bytes are every trunk
    weight (the embedding table counts only when it is also the lm_head) plus the KV cache
    at the context; `of_roofline` = roofline_ms / our greedy decode ms;
  * `decode_compiled_greedy_ms`: the greedy decode step again as one compiled graph over
    fixed KV buffers and, for a hybrid, its Gated DeltaNet states (bench.compiled_ar): far
    below our decode, the AR loop is bound by building its graph (null where our AR loop is
    already compiled, a hybrid on CUDA: `decode` is that figure);
  * `decode_host_split`: the greedy decode step's host time (building and submitting the
    next step) against its wait for the device, and its primitives (bench.host): near-zero
    wait means the step is host-bound, and fewer primitives, not faster kernels, make it
    faster (on a CPU the arithmetic itself runs on the host: the split says nothing there;
    on a GPU, a step that commits more than MLX's 10 command buffers in flight makes the
    host wait inside `async_eval`, and only `build_ms`, Python building the graph, is the
    host's alone: bench.host's docstring);
  * forward of 1..6 tokens (cache trimmed back after each: fixed shapes), and each as a
    multiple of the 1-token forward; the same forwards run back to back, each handed to the
    device before the last finishes (`forward_pipelined_ms_by_tokens`), and each as a
    multiple of our decode step (`forward_pipelined_over_decode`); for a dense model the
    same forwards compiled over fixed KV buffers as the fused MTP loop verifies, back to back
    (`forward_compiled_ms_by_tokens`, `forward_compiled_over_decode`: issue 22's verify
    target in the form the engine runs it, and `forward_compiled_over_one_token`); with
    `--small-m-kernel`, again with the small-M quantized kernel installed
    (small_m_qmm.py; quantized dtypes, CUDA only); with `--small-m-loops` also decode (with
    its host split) and cycles with it, the kernel's forwards then over the faster of the two
    greedy decode steps (`small_m_kernel` in the report: its
    decode steps take the vector layout on matrices of LARGE_MATRIX_VALUES weights or more;
    `--decode-vector-values 16777216,0` times the greedy decode again with that threshold
    moved, `decode_ms_by_vector_values`: which matrices a decode step should route);
    `--attention-forms one-pass,two-pass,split,0` times the greedy decode as served, the
    compiled AR loop (where the served one is op by op: past 1,024-token prompts) and the
    greedy depth-3 cycle again with the fused loops attending by each of those forms of the
    buffer attention (`MTPLX_BUFFER_ATTENTION`'s values; `0`: MLX's masked attention), in
    two rounds (the second in reverse order) in this process, `by_attention_form`: between
    processes whole steps swung more than the forms differ (2026-12-06, sixth session);
    `auto` is the default, mma (split for other heads) from 2,048 slots
    (buffer_attention.form_for); a form ending in `+pool` (`auto+pool`) runs with the loops'
    offsets and the kernels' scale left in MLX's managed small-array pool
    (buffer_attention.scalars_in_pool), as before they were moved to device memory;
    `+in_place`, `+bias_once` and `+hoist` (any of them, after the form or its `+pool`) turn
    on the small-M kernel's forms with fewer instructions a weight (small_m_qmm.VECTOR_IN_PLACE,
    VECTOR_BIAS_ONCE, MMA_HOIST), `+mma_decode` its decode
    steps' products of 64M weights or more on the tensor cores (DECODE_MMA_VALUES),
    `+persistent` the vector layout's persistent form in 264 blocks (VECTOR_PERSISTENT_BLOCKS);
    each is off where not named, so `auto+in_place+hoist,auto+in_place+hoist+persistent`
    times whole steps as served since 2026-12-07 and with the decode products in the
    persistent form;
    `--kernel-decode-from never` keeps decode steps on MLX's matvec for the whole run (the
    kernel on verify rows only, which is what a hybrid or 8-bit model gets by default:
    small_m_qmm.decode_wanted, since their decode ran slower through it), `--kernel-decode-from
    N` puts them on the vector layout from N weights a matrix, whatever the model;
  * `--decode-only`: the decode figures above alone (and the kernel's, with
    `--small-m-kernel`), no forwards, cycles or divergence: for comparing MLX settings
    that only a fresh process takes (MLX_USE_CUDA_GRAPHS, MLX_MAX_OPS_PER_BUFFER); with
    `--attention-forms` then the forms' figures too (under the kernel's figures with
    `--small-m-kernel`, else `by_attention_form` at the top), and no other cycles;
  * with `--prefill-tokens N`: ms to prefill N random tokens into a fresh cache (`prefill`);
    for a hybrid also with its GDN layers chunked and on mlx-lm's per-token loop
    (`gdn_paths_ms`: on CUDA the served path is the chunked one, gdn_chunked.chunked_prefill);
  * `--row-invariant`: wherever the kernel is installed (above, and for the divergence
    below), every product of 1..7 rows takes its tensor-core layout, decode steps included
    (small_m_qmm.install's `row_invariant`: a verify row then rounds as a decode step);
    without it the kernel's figures above take the mixed routing (small_m_qmm.route's rules
    by row count), row-invariant inside the MTP cycles where served so (a dense 27B/32B-class
    model: small_m_qmm.cycle_row_invariant_wanted; the report's `cycle_row_invariant`;
    MTPLX_ROW_INVARIANT=0 for the mixed routing there too), and the divergence below the
    routing served (row-invariant for a hybrid: small_m_qmm.row_invariant_wanted);
    `--row-invariant-beside` times the kernel's figures twice in one process, as served and
    row-invariant (its keys end in `_row_invariant`: `small_m_kernel_row_invariant`...), since
    two processes' decode steps differed by up to 45% on the H200; `--mma-configs 4x4,4x2,8x4s2`
    times them again (in the run's routing) with the kernel's mma layout at 4 warps a block
    and 4 or 2 groups a lane loads before use, or 8 x 4 pipelined through 2 stages of shared
    memory (`small_m_kernel_by_mma_config`; shipped: small_m_qmm.MMA_WARPS,
    MMA_GROUPS_PER_LOAD and MMA_STAGES); `--kv-write-beside` times them again with the
    fused loops' caches writing their rows by slice_update instead of the served scatter
    (fused.slice_update_writes; keys ending in `_slice_update`: that write's cost grows with
    the buffer on CUDA, so try it at `--context 8192` too); `--stacked` times them once more,
    last, with the projections that read one input stacked into one product (stacked.py;
    keys ending in `_stacked`);
  * `--qk-norm-rope`: every figure with the attention layers' query and key norms and rope as
    one kernel (qk_norm_rope.py, MTPLX_QK_NORM_ROPE=1's path; mlx-lm's reference decode runs
    the swapped layers too): for the greedy divergence with it;
  * with `--divergence-tokens N`: greedy AR and greedy MTP at `--divergence-depth` (3) over N
    tokens through the engine's own loops, the kernel as served (`greedy_divergence`): every
    position where they differ (MTP resynchronised on AR's tokens after each, up to
    `--divergence-limit`, 32) and the logit gaps there (issue 22, point 4); with
    `--gdn-chunked` a hybrid's verifies and prompts take the chunked GDN form on any backend,
    as on CUDA, so a CPU run meets the GPU's divergences (bench.gdn_rounding says why);
  * a whole speculative cycle at each depth, greedy and sampled: the engine's own loop
    (fused where the decode_loop setting allows, hybrid models too, as served) run for
    `--cycles` cycles after warm-up, ms per cycle and as a multiple of our decode step;
  * projected MTP/AR at MTPLX's published acceptance profile (97.6 / 95.2 / 88.1 / 75.6% of
    cycles accept depth 1 / 2 / 3 / 4): (1 + sum of the first K rates) * decode_ms / cycle_ms(K),
    at each temperature with that temperature's decode and cycle costs (depths <= 4).
    `--cycle-temperatures 0.6` times the cycles at T=0.6 alone (each temperature and depth is
    a graph to compile: 5-55 s each on a fresh GPU machine at 4B size).

A random head accepts almost nothing, so each measured cycle commits about one token; the
cycle's cost is what is measured, the acceptance is the profile's.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mtplxd.engine.bench.ar_reference import mlx_lm_decode_ms, ours_decode_ms
from mtplxd.engine.bench.harness import bench_parser, command_line, machine, write_report
from mtplxd.engine.bench.small_m import mma_config_name, parse_mma_configs
from mtplxd.engine.bench.verify import (
    DIMS, logit_gaps, measure_compiled_forward_costs, measure_forward_costs, measure_pipelined_forward_costs,
)
from mtplxd.engine.interface import SamplingParams
from mtplxd.engine.model.loader import model_dtype

PROG = "python -m mtplxd.engine.bench.real_size"
BANDWIDTH_BYTES_PER_S = 4.3e12  # H200 device-to-device copy (docs/benchmarks.md)
PROFILE = (0.976, 0.952, 0.881, 0.756)  # MTPLX's published acceptance at depths 1..4
TEMPERATURES = (0.0, 0.6)
DIVERGENCE_LIMIT = 32  # divergences `greedy_divergence` locates before it stops looking

_HYBRID_27B = dict(
    hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, full_attention_interval=4,
    num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
    linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, vocab_size=248320, tie_word_embeddings=False)
_TINY_HYBRID = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=4, full_attention_interval=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
    linear_conv_kernel_dim=4, vocab_size=512, tie_word_embeddings=False)

SIZES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-4b": ("qwen3", DIMS["qwen3-4b"]),
    # Qwen/Qwen3-32B (config.json of the release): 64 layers, hidden 5120, GQA 64/8 x 128.
    "qwen3-32b": ("qwen3", dict(hidden_size=5120, num_hidden_layers=64, intermediate_size=25600,
                                num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                                vocab_size=151936, tie_word_embeddings=False)),
    "hybrid-27b": ("qwen3_5", _HYBRID_27B),
    "tiny": ("qwen3", dict(DIMS["tiny"], hidden_size=128, intermediate_size=256, head_dim=32)),
    # A CPU-sized dense qwen3 (7M parameters, a 16k tied vocabulary): MLX's CPU bf16 and
    # quantized matmuls are slow (a 130M model took 1.6 s a 4-bit step here), so this is
    # the size where both loops decode a few hundred tokens in minutes on this machine.
    "mid": ("qwen3", dict(hidden_size=256, num_hidden_layers=4, intermediate_size=768,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                          vocab_size=16384, tie_word_embeddings=True)),
    "tiny-hybrid": ("qwen3_5", _TINY_HYBRID),
    # The 27B hybrid's layers (64: 48 Gated DeltaNet, 16 gated attention) at the tiny widths:
    # its graph has the 27B step's primitives, so a CPU measures the host's share of a step.
    "hybrid-27b-layers": ("qwen3_5", dict(_TINY_HYBRID, num_hidden_layers=64,
                                          full_attention_interval=4)),
}
DTYPES: dict[str, int | None] = {"bf16": None, "8bit": 8, "4bit": 4, "f32": None}
# The float type a dtype's weights (and so its activations) are held in: bf16 and the
# quantized dtypes' scales in bf16; `f32` keeps the model in float32, where rounding is
# 2^16 times finer (the exactness checks' control: a divergence that bf16 rounding explains
# shrinks to a near-tie there).
FLOAT_TYPES: dict[str, mx.Dtype] = {"f32": mx.float32}


# --- building ----------------------------------------------------------------------------


def build_model(size: str, dtype: str, seed: int = 0) -> tuple[nn.Module, Any]:
    """(mlx-lm model with a random `.mtp` head, its family spec), weights evaluated: the same
    weights in every process (MLX's global generator, which its initialisers draw from, is
    seeded with `seed` first; unseeded, each process measured another random model)."""
    from mlx_lm.models import qwen3, qwen3_5

    from mtplxd.engine.model.families import get_family
    from mtplxd.engine.model.mtp_head import MTPHead

    family, dims = SIZES[size]
    spec = get_family(family)
    mx.random.seed(seed)
    if family == "qwen3":
        config = dict(model_type="qwen3", rms_norm_eps=1e-6, max_position_embeddings=40960,
                      rope_theta=1000000.0, **dims)
        model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    else:
        text = dict(model_type="qwen3_5_text", rms_norm_eps=1e-6, max_position_embeddings=262144,
                    attn_output_gate=True, attention_bias=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                     "partial_rotary_factor": 0.25},
                    **dims)
        model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict({"model_type": "qwen3_5", "text_config": text}))
    text_args = spec.text_args(model.args)
    model.mtp = MTPHead(text_args.hidden_size, text_args.rms_norm_eps, spec.build_mtp_layer(text_args))
    materialize(model, spec.text_model(model).model.layers, DTYPES[dtype],
                FLOAT_TYPES.get(dtype, mx.bfloat16))
    return model, spec


def materialize(model: nn.Module, layers: list[nn.Module], bits: int | None,
                float_type: mx.Dtype = mx.bfloat16) -> None:
    """Cast to `float_type` (bf16) and (bits) quantize in groups of 64, one decoder layer at a
    time and then the rest (embedding, norms, lm_head, MTP head), so the float32 initial
    values of one layer at most are alive at once (a 32B model's would be 131 GB)."""
    for block in [*layers, model]:
        block.set_dtype(float_type)
        if bits is not None:
            nn.quantize(block, group_size=64, bits=bits, class_predicate=_quantizable)
        mx.eval(block.parameters())


def _quantizable(_: str, module: nn.Module) -> bool:
    # Layers already quantized have no to_quantized; widths 64 does not divide stay bf16.
    return hasattr(module, "to_quantized") and module.weight.shape[-1] % 64 == 0


def bytes_read_per_step(model: nn.Module, trunk: Any, context: int) -> dict[str, int]:
    """What one decode step must read: every trunk weight (an untied embedding table only
    gives one row) and the KV cache of `context` tokens (attention layers, in the model's
    float type)."""
    params = {k: v for k, v in tree_flatten(model.parameters()) if not k.startswith("mtp.")}
    weights = sum(v.nbytes for v in params.values())
    embed = sum(v.nbytes for k, v in params.items() if "embed_tokens" in k)
    tied = trunk._tied()
    args = trunk.text.args
    attention_layers = sum(1 for layer in trunk.text.model.layers if not getattr(layer, "is_linear", False))
    element = getattr(mx, model_dtype(model)).size  # the KV cache's: the model's float type
    kv = attention_layers * 2 * args.num_key_value_heads * args.head_dim * element * context
    return {"weights_bytes": weights, "bytes_read_per_step": weights - (0 if tied else embed) + kv,
            "kv_bytes": kv}


# --- measuring ---------------------------------------------------------------------------


def sampling(temperature: float) -> SamplingParams:
    """The bench's settings: greedy, or top-p 0.95 at the temperature."""
    return SamplingParams(temperature=temperature, top_p=0.95 if temperature > 0 else 1.0)


def engine_loop(trunk: Any, head: Any, prompt: list[int], depth: int, temperature: float,
                first: int | None = None) -> tuple[Any, int, bool]:
    """The engine's own decode loop over `prompt` after its prefill: (cycles, first token,
    fused or compiled?). Depth 0 is the AR loop as served (the compiled one where
    fused_ar_wanted); else the MTP loop generation.py chooses (fused where the cache allows
    it, hybrid models' included, else stepwise). `first` given is taken as the
    first token instead of the prefill's pick (a resynchronised run: `greedy_divergence`)."""
    from mtplxd.engine.decoding.autoregressive import ar_cycles
    from mtplxd.engine.decoding.fused import FusedSpeculativeDecoder, fused_supported
    from mtplxd.engine.decoding.fused_ar import fused_ar_cycles, fused_ar_wanted
    from mtplxd.engine.decoding.sampling import TokenHistory, pick_first
    from mtplxd.engine.decoding.speculative import SpeculativeDecoder

    params = sampling(temperature)
    cache = trunk.make_cache()
    hiddens, logits = trunk.prefill(prompt, cache)
    history = TokenHistory(logits.shape[-1], prompt)
    if first is None:
        first = pick_first(logits, params, history, 0, len(prompt))
    else:
        history.append([first])
    if depth == 0:  # the AR loop as served: compiled where fused_ar_wanted (hybrids on CUDA)
        compiled = fused_ar_wanted(trunk, cache, len(prompt))
        loop = fused_ar_cycles if compiled else ar_cycles
        return loop(trunk, cache, params, history, 0, first, len(prompt)), first, compiled
    fused = trunk.decode_loop == "fused" and fused_supported(trunk, cache, hybrid=True)  # as served
    decoder = (FusedSpeculativeDecoder if fused else SpeculativeDecoder)(
        trunk, head, cache, params, history, 0, depth)
    return decoder.cycles(hiddens, prompt, first), first, fused


def greedy_divergence(trunk: Any, head: Any, prompt: list[int], depth: int, tokens: int,
                      max_divergences: int = DIVERGENCE_LIMIT) -> dict[str, Any]:
    """Greedy AR and greedy MTP at `depth` through the engine's own loops over `tokens` tokens
    from `prompt`, resynchronised at each divergence: MTP restarts from the prompt and AR's
    tokens up to and including the one it missed, so every divergence in the span is found
    (up to `max_divergences`), not only the first. Each with its logit gaps
    (verify.logit_gaps: a near-tie is what issue 22 accepts); the first's are also the
    report's own keys, as before the resync."""
    def ar_run() -> list[int]:
        loop, first, _ = engine_loop(trunk, head, prompt, 0, 0.0)
        out = [first]
        while len(out) < tokens:
            out += next(loop)
        loop.close()
        return out[:tokens]

    def mtp_until_divergence(ar: list[int], start: int) -> tuple[int, int] | None:
        """MTP from AR's tokens up to `start` (inclusive): where it next differs, and its token."""
        loop, _, _ = engine_loop(trunk, head, prompt + ar[:start], depth, 0.0, first=ar[start])
        position = start + 1
        try:
            while position < tokens:
                for token in next(loop)[:tokens - position]:
                    if token != ar[position]:
                        return position, token
                    position += 1
            return None
        finally:
            loop.close()

    started = time.perf_counter()
    ar = ar_run()
    found: list[dict[str, Any]] = []
    resync_at = 0
    while len(found) < max_divergences:
        missed = mtp_until_divergence(ar, resync_at)
        if missed is None:
            break
        resync_at, token = missed
        found.append({"token": resync_at, **logit_gaps(trunk, prompt, ar, resync_at, token)})
    report: dict[str, Any] = {"tokens": tokens, "depth": depth, "identical": not found,
                              "first_divergence": found[0]["token"] if found else None}
    if found:
        report.update({k: v for k, v in found[0].items() if k != "token"})
    report["divergences"] = found
    # Every divergence found when fewer than the limit; else the span up to the last one.
    report["tokens_checked"] = tokens if len(found) < max_divergences else found[-1]["token"] + 1
    report["largest_mtp_token_logit_gap"] = max((d["mtp_token_logit_gap"] for d in found), default=None)
    report["seconds"] = time.perf_counter() - started
    return report


def prefill_figures(trunk: Any, vocab: int, tokens: int, hybrid: bool) -> dict[str, Any]:
    """Ms to prefill `tokens` random tokens into a fresh cache in the trunk's chunks, the
    second of two runs (the first compiles). A hybrid's both ways, `gdn_paths_ms`: its GDN
    layers chunked (`chunked_prefill`) and on the per-token loop (mlx-lm's); `ms` is the one
    this backend serves (gdn_chunked.active(): chunked on CUDA)."""
    from mtplxd.engine.model import gdn_chunked

    prompt = mx.random.randint(0, vocab, (tokens,), key=mx.random.key(2)).tolist()

    def timed() -> float:
        for run in range(2):
            started = time.perf_counter()
            _, logits = trunk.prefill(prompt, trunk.make_cache())
            mx.eval(logits)
        return (time.perf_counter() - started) * 1000

    paths: dict[str, float] = {}
    if hybrid:
        served_path = "chunked" if gdn_chunked.active() else "per_token"
        for name, chunked in (("chunked", True), ("per_token", False)):
            gdn_chunked.force(chunked)
            try:
                paths[name] = timed()
            finally:
                gdn_chunked.force(None)
        served = paths[served_path]
    else:
        served = timed()
    figures: dict[str, Any] = {"tokens": tokens, "ms": served, "tokens_per_s": tokens / served * 1000}
    if paths:
        figures["gdn_paths_ms"] = paths
    return figures


def decode_host_split(trunk: Any, vocab: int, prompt: list[int], steps: int) -> dict[str, Any]:
    """Is the greedy decode step bound by the host or the device (issue 22, point 6)? Per
    step, the time to build and submit the next step (`host_ms`) against the time then spent
    waiting for the device (`wait_ms`), and the primitives a step hands the device
    (bench.host.measure_ar; at least 8 steps skipped as warm-up)."""
    from mtplxd.engine.bench.host import SKIPPED, measure_ar

    greedy = sampling(0.0)
    measure_ar(trunk, vocab, prompt[:64], greedy, 4)  # warm-up at a short context
    return measure_ar(trunk, vocab, prompt, greedy, SKIPPED + max(steps, 4))


def _phases(config: str, started: float) -> Callable[[str], None]:
    """phase(name): a line on stderr as each phase of a config starts, with the seconds so
    far, so a run cut by its time cap says where it was."""
    def phase(name: str) -> None:
        print(f"[{config}] {time.perf_counter() - started:.0f} s: {name}", file=sys.stderr, flush=True)
    return phase


def _pipelined_forwards(trunk, cache, vocab: int, repeats: int, decode_ms: float) -> dict[str, Any]:
    """Forwards of 1..6 tokens run back to back (bench.verify.measure_pipelined_forward_costs),
    and each as a multiple of our greedy decode step, which is pipelined the same way: the
    verify's cost in decode steps, without the synchronous forward's host time on top. Then
    the same forwards compiled over fixed buffers, as the fused MTP loop verifies
    (measure_compiled_forward_costs; dense models), over the decode step and over their own
    1-token forward."""
    steps = max(2 * repeats, 8)
    ms = measure_pipelined_forward_costs(trunk, cache, vocab, range(1, 7), steps=steps)
    compiled = measure_compiled_forward_costs(trunk, cache, vocab, range(1, 7), steps=steps)
    return {"forward_pipelined_ms_by_tokens": ms,
            "forward_pipelined_over_decode": {k: v / decode_ms for k, v in ms.items()} if decode_ms else {},
            "forward_compiled_ms_by_tokens": compiled,
            "forward_compiled_over_decode": {k: v / decode_ms for k, v in compiled.items()} if decode_ms else {},
            "forward_compiled_over_one_token": {k: v / compiled["1"] for k, v in compiled.items()} if compiled else {}}


def compiled_decode_ms(trunk: Any, prompt: list[int], tokens: int) -> float | None:
    """ms per greedy token of the compiled fixed-buffer AR step (bench.compiled_ar), for
    models whose cache the fused loops take (dense and hybrid); None for the others, and
    where our AR already decodes in a compiled loop at this prompt (fused_ar: a hybrid on
    CUDA, a dense model with the kernel on its decode steps), whose figure `decode` is:
    timing it twice cost a GPU run its seconds."""
    from mtplxd.engine.bench.compiled_ar import compiled_ar_supported, compiled_greedy_decode
    from mtplxd.engine.decoding.fused_ar import fused_ar_wanted

    if not compiled_ar_supported(trunk) or fused_ar_wanted(trunk, trunk.make_cache(), len(prompt)):
        return None
    return compiled_greedy_decode(trunk, prompt, max(tokens, 8))[1]


def loop_cycle_ms(trunk: Any, head: Any, prompt: list[int], depth: int, temperature: float,
                  cycles: int, warmup: int = 3) -> dict[str, float]:
    """ms per cycle of the engine's own MTP loop at `depth` (fused where the cache allows it,
    as generation.py chooses), and the tokens it committed per cycle."""
    loop, _, fused = engine_loop(trunk, head, prompt, depth, temperature)
    for _ in range(warmup):
        next(loop)
    committed = 0
    start = time.perf_counter()
    for _ in range(cycles):
        committed += len(next(loop))
    elapsed = time.perf_counter() - start
    loop.close()
    return {"ms": elapsed * 1000 / cycles, "tokens_per_cycle": committed / cycles,
            "loop": "fused" if fused else "stepwise"}


def projected_speedups(decode_ms: float, cycle_ms: dict[str, float]) -> dict[str, float]:
    """MTP/AR at the published acceptance profile, per depth <= len(PROFILE)."""
    return {depth: (1 + sum(PROFILE[:int(depth)])) * decode_ms / ms
            for depth, ms in cycle_ms.items() if int(depth) <= len(PROFILE) and ms > 0}


def measure_config(size: str, dtype: str, *, context: int, depths: list[int], decode_tokens: int,
                   cycles: int, repeats: int, small_m_kernel: bool,
                   cycle_temperatures: tuple[float, ...] = TEMPERATURES,
                   kernel_loops: bool = False, decode_vector_values: tuple[int, ...] = (),
                   divergence_tokens: int = 0, divergence_depth: int = 3,
                   divergence_limit: int = DIVERGENCE_LIMIT, kernel_decode: bool | None = None,
                   decode_only: bool = False, prefill_tokens: int = 0,
                   row_invariant: bool = False, row_invariant_beside: bool = False,
                   mma_configs: tuple[tuple[int, int, int], ...] = (),
                   kv_write_beside: bool = False, stacked: bool = False,
                   attention_forms: tuple[str, ...] = (), qk_norm_rope: bool = False) -> dict[str, Any]:
    """Every figure of one size and dtype (see the module docstring), JSON-ready.
    `kernel_decode`: whether the kernel's decode steps take it (small_m_qmm.install's
    `decode`); None follows small_m_qmm.decode_wanted. `row_invariant`: every kernel install
    routes 1..7 rows to the tensor cores (small_m_qmm.install's `row_invariant`);
    `row_invariant_beside` times the kernel's figures again routed so, in this process, under
    keys ending in `_row_invariant` (its cycles over the fastest decode before it, the first
    routing's included). `mma_configs`: (warps, groups per load, stages) of the kernel's mma
    layout (stages 0: the plain layout), each timed again in this process after the routings (`small_m_kernel_by_mma_config`).
    `kv_write_beside`: then once more with the fused loops' caches written by slice_update
    (keys ending in `_slice_update`). `decode_only`: the
    decode figures alone (with the kernel's where `small_m_kernel`), no forwards or cycles.
    `stacked`: last, the projections that read one input stacked into one product (every
    MLP's gate and up, a GDN layer's four inputs, attention's q, k and v: stacked.py) and the kernel's figures timed
    again in this process, as served (keys ending in `_stacked`). `qk_norm_rope`: every
    figure with the query and key norms and rope as one kernel a layer (qk_norm_rope.py)."""
    from mtplxd.engine.decoding import buffer_attention
    from mtplxd.engine.model import gdn_kernel, small_m_qmm
    from mtplxd.engine.model import qk_norm_rope as norm_rope
    from mtplxd.engine.model.trunk import Trunk

    started = time.perf_counter()
    phase = _phases(f"{size} {dtype}", started)
    model, spec = build_model(size, dtype)
    build_seconds = time.perf_counter() - started
    norm_rope_layers = norm_rope.install(model, force=True) if qk_norm_rope else 0
    trunk = Trunk(model, spec)
    vocab = trunk.text.args.vocab_size
    prompt = mx.random.randint(0, vocab, (context,), key=mx.random.key(1)).tolist()
    sizes = bytes_read_per_step(model, trunk, context)
    roofline_ms = sizes["bytes_read_per_step"] / BANDWIDTH_BYTES_PER_S * 1000
    hybrid = spec.model_type != "qwen3"
    entry: dict[str, Any] = {"size": size, "dtype": dtype, "family": spec.model_type, **sizes,
                             "roofline_ms": roofline_ms, "build_seconds": build_seconds,
                             "qk_norm_rope_layers": norm_rope_layers,
                             "gdn_verify": gdn_kernel.verify_path_name() if hybrid else None,
                             # Asked here, outside any compiled trace: the first ask probes the kernel.
                             "gdn_decode": gdn_kernel.path_name() if hybrid else None,
                             "cache_attention": buffer_attention.path_name()}

    if prefill_tokens:
        phase(f"prefill of {prefill_tokens} tokens")
        entry["prefill"] = prefill_figures(trunk, vocab, prefill_tokens, hybrid)

    decode: dict[str, dict[str, float]] = {}
    phase("decode: ours, mlx-lm's, the host split, the compiled step")
    for temperature in TEMPERATURES:
        ours_decode_ms(trunk, prompt[:64], 4, temperature)  # warm-up: this setting's graphs
        mlx_lm_decode_ms(model, prompt[:64], 4, temperature)
        ours = ours_decode_ms(trunk, prompt, decode_tokens, temperature)
        reference = mlx_lm_decode_ms(model, prompt, decode_tokens, temperature)
        decode[str(temperature)] = {"ours_ms": ours, "mlx_lm_ms": reference,
                                    "speed_vs_mlx_lm": reference / ours if ours else 0.0}
    greedy_decode = decode["0.0"]["ours_ms"]
    entry["decode"] = decode
    entry["of_roofline"] = roofline_ms / greedy_decode if greedy_decode else 0.0
    entry["mlx_lm_of_roofline"] = roofline_ms / decode["0.0"]["mlx_lm_ms"]
    entry.update(_decode_step_figures(trunk, prompt, decode_tokens, phase))
    if decode_only:
        if small_m_kernel and DTYPES[dtype] is not None:
            phase("the small-M kernel: decode")
            with kernel_installed(model, trunk, force=True, decode=kernel_decode,
                                  row_invariant=row_invariant) as switched:
                entry["small_m_kernel_layers"] = switched
                entry["small_m_kernel"] = _kernel_decode(trunk, prompt, decode_tokens, roofline_ms, phase)
                if attention_forms:
                    phase("the small-M kernel: the attention forms")
                    entry["small_m_kernel"]["by_attention_form"] = _by_attention_form(
                        trunk, model, prompt, decode_tokens, cycles, attention_forms)
        elif attention_forms:
            phase("the attention forms")
            entry["by_attention_form"] = _by_attention_form(trunk, model, prompt, decode_tokens, cycles,
                                                            attention_forms)
        entry["seconds"] = time.perf_counter() - started
        return entry

    phase("forwards")
    cache = trunk.make_cache()
    trunk.prefill(prompt, cache)
    forward = measure_forward_costs(trunk, cache, vocab, 0, repeats, token_counts=range(1, 7))
    entry["forward_ms_by_tokens"] = forward
    entry["forward_over_one_token"] = {k: v / forward["1"] for k, v in forward.items()}
    entry.update(_pipelined_forwards(trunk, cache, vocab, repeats, greedy_decode))
    if small_m_kernel and DTYPES[dtype] is not None:
        routings = [row_invariant] + ([True] if row_invariant_beside and not row_invariant else [])
        fastest = decode  # AR at its fastest decode so far: each routing's cycles are over it
        for invariant in routings:
            phase("the small-M kernel" + (", row-invariant" if invariant else "") + ": forwards, decode and cycles")
            figures = _kernel_figures(trunk, model, cache, prompt, forward, fastest, depths, cycles,
                                      decode_tokens, cycle_temperatures, roofline_ms, repeats,
                                      kernel_decode=kernel_decode, row_invariant=invariant,
                                      kernel_loops=kernel_loops, decode_vector_values=decode_vector_values,
                                      attention_forms=attention_forms if invariant == row_invariant else ())
            # The run's own routing reports under the plain keys; the one timed beside it
            # (--row-invariant-beside) under the same keys ending in _row_invariant.
            suffix = "_row_invariant" if invariant != row_invariant else ""
            entry.update({key + suffix: value for key, value in figures.items()})
            if "small_m_kernel" in figures:
                fastest = _faster_decode(fastest, figures["small_m_kernel"]["decode_ms"])
        by_config: dict[str, Any] = {}
        for warps, groups, stages in mma_configs:
            phase(f"the small-M kernel, mma layout {warps} warps x {groups} groups a load, {stages} stages")
            with mma_shape(warps, groups, stages):
                by_config[mma_config_name(warps, groups, stages)] = _kernel_figures(
                    trunk, model, cache, prompt, forward, fastest, depths, cycles, decode_tokens,
                    cycle_temperatures, roofline_ms, repeats, kernel_decode=kernel_decode,
                    row_invariant=row_invariant, kernel_loops=kernel_loops, decode_vector_values=())
        if by_config:
            entry["small_m_kernel_by_mma_config"] = by_config
        if kv_write_beside:
            from mtplxd.engine.decoding.fused import slice_update_writes

            phase("the small-M kernel, the fused loops' caches written by slice_update")
            with slice_update_writes():  # kernel_installed drops the graphs traced with it
                figures = _kernel_figures(trunk, model, cache, prompt, forward, fastest, depths, cycles,
                                          decode_tokens, cycle_temperatures, roofline_ms, repeats,
                                          kernel_decode=kernel_decode, row_invariant=row_invariant,
                                          kernel_loops=kernel_loops, decode_vector_values=())
            entry.update({key + "_slice_update": value for key, value in figures.items()})
    del cache

    cycle: dict[str, dict[str, Any]] = {}
    phase("cycles")
    for temperature in cycle_temperatures:
        by_depth = {str(d): loop_cycle_ms(trunk, model.mtp, prompt, d, temperature, cycles) for d in depths}
        decode_ms = decode[str(temperature)]["ours_ms"]
        ms = {d: v["ms"] for d, v in by_depth.items()}
        cycle[str(temperature)] = {
            "cycle_ms_by_depth": ms,
            "cycle_over_decode_by_depth": {d: v / decode_ms for d, v in ms.items()},
            "tokens_per_cycle_random_head": {d: v["tokens_per_cycle"] for d, v in by_depth.items()},
            "loop": next(iter(by_depth.values()))["loop"] if by_depth else None,
            "projected_mtp_over_ar": projected_speedups(decode_ms, ms),
        }
    entry["cycles"] = cycle
    if divergence_tokens:
        phase("greedy divergence")
        # As served: the small-M kernel where small_m_qmm.default_wanted puts it, routed as
        # small_m_qmm.row_invariant_wanted says (or everywhere, row-invariant, when asked).
        with kernel_installed(model, trunk, row_invariant=row_invariant or None) as served_kernel:
            entry["greedy_divergence"] = {**greedy_divergence(trunk, model.mtp, prompt, divergence_depth,
                                                              divergence_tokens, divergence_limit),
                                          "small_m_kernel": bool(served_kernel),
                                          "row_invariant": small_m_qmm.routed_row_invariant(model),
                                          "cycle_row_invariant": small_m_qmm.routed_row_invariant(
                                              model, in_cycles=True)}
    if stacked and small_m_kernel and DTYPES[dtype] is not None:
        # Last: stacking cannot be undone in this process.
        from mtplxd.engine.model.stacked import stack

        phase("projections stacked: the small-M kernel's forwards, decode and cycles again")
        entry["stacked_groups"] = stack(model)
        cache = trunk.make_cache()
        trunk.prefill(prompt, cache)
        figures = _kernel_figures(trunk, model, cache, prompt, forward, decode, depths, cycles,
                                  decode_tokens, cycle_temperatures, roofline_ms, repeats,
                                  kernel_decode=kernel_decode, row_invariant=row_invariant,
                                  kernel_loops=kernel_loops, decode_vector_values=())
        entry.update({key + "_stacked": value for key, value in figures.items()})
        del cache
    entry["seconds"] = time.perf_counter() - started
    return entry


def _faster_decode(decode: dict[str, dict[str, float]], kernel_ms: dict[str, float]) -> dict[str, dict[str, float]]:
    """`decode` with each temperature's `ours_ms` the faster of it and the kernel's."""
    return {t: {**v, "ours_ms": min(v["ours_ms"], kernel_ms.get(t, v["ours_ms"]))} for t, v in decode.items()}


def _kernel_figures(trunk, model: nn.Module, cache, prompt: list[int], forward: dict[str, float],
                    decode: dict[str, dict[str, float]], depths: list[int], cycles: int,
                    decode_tokens: int, cycle_temperatures: tuple[float, ...], roofline_ms: float,
                    repeats: int, *, kernel_decode: bool | None, row_invariant: bool,
                    kernel_loops: bool, decode_vector_values: tuple[int, ...],
                    attention_forms: tuple[str, ...] = ()) -> dict[str, Any]:
    """The forwards (and with `kernel_loops` the decode and cycles) with the small-M kernel
    installed with this routing, then taken out again: the keys measure_config reports."""
    from mtplxd.engine.model import small_m_qmm

    vocab = trunk.text.args.vocab_size
    greedy_decode = decode["0.0"]["ours_ms"]
    with kernel_installed(model, trunk, force=True, decode=kernel_decode, row_invariant=row_invariant) as switched:
        out: dict[str, Any] = {"small_m_kernel_layers": switched,
                               "cycle_row_invariant": small_m_qmm.routed_row_invariant(model, in_cycles=True)}
        if not switched:
            return out
        with_kernel = measure_forward_costs(trunk, cache, vocab, 0, repeats, token_counts=range(1, 7))
        out["forward_ms_by_tokens_small_m_kernel"] = with_kernel
        out["forward_over_one_token_small_m_kernel"] = {k: v / forward["1"] for k, v in with_kernel.items()}
        out.update({f"{key}_small_m_kernel": value for key, value in
                    _pipelined_forwards(trunk, cache, vocab, repeats, greedy_decode).items()})
        if kernel_loops:
            out["small_m_kernel"] = _kernel_loops(trunk, model, prompt, decode, depths, cycles,
                                                  decode_tokens, cycle_temperatures, roofline_ms)
            out.update(_over_faster_decode(out, min(greedy_decode, out["small_m_kernel"]["decode_ms"]["0.0"])))
            if decode_vector_values:
                out["small_m_kernel"]["decode_ms_by_vector_values"] = _decode_by_vector_values(
                    trunk, prompt, decode_tokens, decode_vector_values)
            if attention_forms:
                out["small_m_kernel"]["by_attention_form"] = _by_attention_form(
                    trunk, model, prompt, decode_tokens, cycles, attention_forms)
    return out


def _over_faster_decode(figures: dict[str, Any], decode_ms: float) -> dict[str, Any]:
    """The kernel's forwards (`figures`' `*_ms_by_tokens_small_m_kernel`) over `decode_ms`,
    the faster greedy decode step once the kernel's decode is timed too: AR runs the faster
    one, as the cycles' figures assume (`_kernel_loops`). Until 2026-12-07 they were set over
    stock's decode, which made the kernel's forwards look cheaper than they are."""
    return {f"{form}_over_decode_small_m_kernel": {k: v / decode_ms for k, v in
                                                   figures[f"{form}_ms_by_tokens_small_m_kernel"].items()}
            for form in ("forward_pipelined", "forward_compiled")}


def _kernel_loops(trunk, model: nn.Module, prompt: list[int], decode: dict[str, dict[str, float]],
                  depths: list[int], cycles: int, decode_tokens: int,
                  cycle_temperatures: tuple[float, ...], roofline_ms: float) -> dict[str, Any]:
    """Our decode and cycles again with the small-M kernel installed (routed by
    small_m_qmm.route). The projection's AR is the faster of our decode with and without the
    kernel: AR would run the faster one."""
    from mtplxd.engine.model import small_m_qmm

    out: dict[str, Any] = {"min_rows": dict(small_m_qmm.MIN_ROWS),
                           "large_matrix_values": small_m_qmm.LARGE_MATRIX_VALUES,
                           "decode_ms": {}, "cycles": {}}
    out.update(_kernel_decode(trunk, prompt, decode_tokens, roofline_ms))
    for temperature in cycle_temperatures:
        ar_ms = min(out["decode_ms"][str(temperature)], decode[str(temperature)]["ours_ms"])
        ms = {str(d): loop_cycle_ms(trunk, model.mtp, prompt, d, temperature, cycles)["ms"] for d in depths}
        out["cycles"][str(temperature)] = {
            "cycle_ms_by_depth": ms,
            "cycle_over_decode_by_depth": {d: v / ar_ms for d, v in ms.items()},
            "projected_mtp_over_ar": projected_speedups(ar_ms, ms),
        }
    return out


def _kernel_decode(trunk, prompt: list[int], decode_tokens: int, roofline_ms: float,
                   phase: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Our decode with the small-M kernel installed, greedy and sampled, its fraction of the
    roofline, and its host split and compiled step (_decode_step_figures)."""
    out: dict[str, Any] = {"decode_ms": {}}
    for temperature in TEMPERATURES:
        ours_decode_ms(trunk, prompt[:64], 4, temperature)  # warm-up: the kernel's graphs
        out["decode_ms"][str(temperature)] = ours_decode_ms(trunk, prompt, decode_tokens, temperature)
    greedy = out["decode_ms"].get("0.0")
    out["of_roofline"] = roofline_ms / greedy if greedy else None
    # The kernel's decode beside stock's split: a faster product that leaves a step no faster
    # points at the host (the 32B 4-bit's decode stayed at 20.1 ms against 20.2).
    out.update(_decode_step_figures(trunk, prompt, decode_tokens, phase))
    return out


def _decode_step_figures(trunk, prompt: list[int], decode_tokens: int,
                         phase: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The greedy decode step's host split and its compiled twin, with the seconds each took
    to measure (`decode_figure_seconds`: a 32B run at MLX's default graph limits once spent
    190 s in its decode phase and did not say where)."""
    seconds: dict[str, float] = {}
    started = time.perf_counter()
    if phase:
        phase("decode host split")
    split = decode_host_split(trunk, trunk.text.args.vocab_size, prompt, decode_tokens)
    seconds["host_split"] = time.perf_counter() - started
    if phase:
        phase("compiled decode step")
    compiled = compiled_decode_ms(trunk, prompt, decode_tokens)
    seconds["compiled"] = time.perf_counter() - started - seconds["host_split"]
    return {"decode_host_split": split, "decode_compiled_greedy_ms": compiled,
            "decode_figure_seconds": seconds}


def _decode_by_vector_values(trunk, prompt: list[int], decode_tokens: int,
                             thresholds: tuple[int, ...]) -> dict[str, float]:
    """Our greedy decode with the kernel, small_m_qmm.LARGE_MATRIX_VALUES set to each threshold
    in turn (0: every quantized matrix of a decode step on the vector layout), then restored.
    The compiled graphs are dropped at each change: a traced step keeps the routing it saw."""
    out: dict[str, float] = {}
    try:
        for values in thresholds:
            with decode_vector_threshold(values):
                trunk.compiled_graphs.clear()
                ours_decode_ms(trunk, prompt[:64], 4, 0.0)  # warm-up: this routing's graphs
                out[str(values)] = ours_decode_ms(trunk, prompt, decode_tokens, 0.0)
    finally:
        trunk.compiled_graphs.clear()
    return out


def _attention_forms(args) -> tuple[str, ...]:
    return tuple(f for f in args.attention_forms.split(",") if f)


def _by_attention_form(trunk, model: nn.Module, prompt: list[int], decode_tokens: int, cycles: int,
                       forms: tuple[str, ...], depth: int = 3) -> dict[str, dict[str, Any]]:
    """Our greedy decode (`decode_ms`: the AR loop this run serves, op by op or compiled),
    the compiled AR loop (`compiled_ar_ms`: None where `decode_ms` is that loop already) and
    the greedy depth-`depth` cycle with the fused loops attending by each of `forms`
    (buffer_attention.KERNEL_ENV's values, each with its FORM_MODIFIERS), in two rounds, the
    second in reverse order: each form's times as a list, and the path /health would name. Each
    form's kernels are probed before anything is traced, and the compiled graphs dropped at each
    change (a traced loop keeps the form it saw); KERNEL_ENV is restored after."""
    from mtplxd.engine.decoding import buffer_attention

    out: dict[str, dict[str, Any]] = {form: {"decode_ms": [], "compiled_ar_ms": [], "cycle_ms": []}
                                      for form in forms}
    before = os.environ.get(buffer_attention.KERNEL_ENV)
    try:
        for order in (forms, forms[::-1]):
            for form in order:
                name, *modifiers = form.split("+")
                os.environ[buffer_attention.KERNEL_ENV] = name
                buffer_attention.prepare_form()
                with buffer_attention.scalars_in_pool("pool" in modifiers), small_m_forms(modifiers):
                    trunk.compiled_graphs.clear()
                    ours_decode_ms(trunk, prompt[:64], 4, 0.0)  # warm-up: this form's graphs
                    out[form]["decode_ms"].append(ours_decode_ms(trunk, prompt, decode_tokens, 0.0))
                    out[form]["compiled_ar_ms"].append(compiled_decode_ms(trunk, prompt, decode_tokens))
                    out[form]["cycle_ms"].append(loop_cycle_ms(trunk, model.mtp, prompt, depth, 0.0, cycles)["ms"])
                out[form]["path"] = buffer_attention.path_name()
    finally:
        if before is None:
            os.environ.pop(buffer_attention.KERNEL_ENV, None)
        else:
            os.environ[buffer_attention.KERNEL_ENV] = before
        trunk.compiled_graphs.clear()
    return out


# What may follow an attention form in `--attention-forms`, each after a "+": `pool` keeps the
# fused loops' scalars in MLX's pool (buffer_attention.scalars_in_pool); the others turn on
# the small-M kernel's form of that name, which is off where not named: small_m_qmm's setting,
# its value on, its value off. `mma_decode`: a decode step's 1-row products of 64M weights or
# more (the 32B's MLP and lm_head) on the mma layout; `persistent`: the vector layout's
# persistent form in 264 blocks (what 132 SMs hold of it at 8 rows a block and 160 threads,
# the 32B's products of K = 5,120; its down_proj's 256-thread blocks fit 132).
SMALL_M_FORMS = {"in_place": ("VECTOR_IN_PLACE", True, False), "bias_once": ("VECTOR_BIAS_ONCE", True, False),
                 "hoist": ("MMA_HOIST", True, False), "mma_decode": ("DECODE_MMA_VALUES", 64 * 2**20, None),
                 "persistent": ("VECTOR_PERSISTENT_BLOCKS", 264, None)}
FORM_MODIFIERS = ("pool", *SMALL_M_FORMS)


@contextmanager
def small_m_forms(names: list[str]) -> Iterator[None]:
    """The small-M kernel's forms named in `names` on (SMALL_M_FORMS), every other off,
    inside; the shipped settings back after. A traced graph keeps the form it saw: the caller
    drops the compiled graphs at each change (_by_attention_form does)."""
    from mtplxd.engine.model import small_m_qmm

    before = {setting: getattr(small_m_qmm, setting) for setting, _, _ in SMALL_M_FORMS.values()}
    try:
        for name, (setting, on, off) in SMALL_M_FORMS.items():
            setattr(small_m_qmm, setting, on if name in names else off)
        yield
    finally:
        for setting, value in before.items():
            setattr(small_m_qmm, setting, value)


@contextmanager
def decode_vector_threshold(values: int | None) -> Iterator[None]:
    """small_m_qmm.LARGE_MATRIX_VALUES (the weights from which a decode step's product takes
    the vector layout) at `values` inside, the previous value back after; None leaves it."""
    from mtplxd.engine.model import small_m_qmm

    before = small_m_qmm.LARGE_MATRIX_VALUES
    if values is not None:
        small_m_qmm.LARGE_MATRIX_VALUES = values
    try:
        yield
    finally:
        small_m_qmm.LARGE_MATRIX_VALUES = before


@contextmanager
def mma_shape(warps: int, groups_per_load: int, stages: int = 0) -> Iterator[None]:
    """The mma layout at `warps` warps a block and `groups_per_load` groups a lane loads
    before using any (both bit widths), pipelined through `stages` stages of shared memory
    where they fit (0: the plain layout), inside; the shipped ones back after. A traced graph
    keeps the shape it saw, so the caller drops the compiled graphs on both sides
    (_kernel_figures does, installing and taking out the kernel)."""
    from mtplxd.engine.model import small_m_qmm

    before = small_m_qmm.MMA_WARPS, dict(small_m_qmm.MMA_GROUPS_PER_LOAD), small_m_qmm.MMA_STAGES
    small_m_qmm.MMA_WARPS = warps
    small_m_qmm.MMA_GROUPS_PER_LOAD = {bits: groups_per_load for bits in before[1]}
    small_m_qmm.MMA_STAGES = stages
    try:
        yield
    finally:
        small_m_qmm.MMA_WARPS, small_m_qmm.MMA_GROUPS_PER_LOAD, small_m_qmm.MMA_STAGES = before


@contextmanager
def kernel_installed(model: nn.Module, trunk, **install: Any) -> Iterator[int]:
    """The small-M kernel installed (small_m_qmm.install's keywords) inside, yielding the
    layers it switched; outside, the stock QuantizedLinear class back (the figures after are
    MLX's own). Both sides drop the compiled graphs: mx.compile replays a traced graph, so a
    class swap alone would leave the cycles on the layers they were traced through."""
    from mtplxd.engine.model import small_m_qmm

    switched = small_m_qmm.install(model, **install)
    trunk.compiled_graphs.clear()
    try:
        yield switched
    finally:
        small_m_qmm.uninstall(model)
        trunk.compiled_graphs.clear()


def _summary_line(entry: dict[str, Any]) -> str:
    line = (f"{entry['size']} {entry['dtype']}: decode {entry['decode']['0.0']['ours_ms']:.2f} ms "
            f"(mlx-lm {entry['decode']['0.0']['mlx_lm_ms']:.2f}), {entry['of_roofline']:.0%} of roofline; ")
    if "forward_over_one_token" in entry:  # not with --decode-only
        forward = entry["forward_over_one_token"]
        temperature, timed = next(iter(entry["cycles"].items()))
        cycles = timed["cycle_over_decode_by_depth"]
        line += (f"forward 2/4/6 = {forward['2']:.2f}/{forward['4']:.2f}/{forward['6']:.2f}x; "
                 f"cycle/decode at T={temperature} by depth "
                 f"{', '.join(f'{d}:{v:.2f}' for d, v in cycles.items())}; ")
    if "greedy_divergence" in entry:
        found = entry["greedy_divergence"]
        line += (f"{len(found['divergences'])} divergences in {found['tokens_checked']} greedy tokens"
                 + (f" (largest MTP-token gap {found['largest_mtp_token_logit_gap']:.3f})"
                    if found["divergences"] else "") + "; ")
    return line + f"{entry['seconds']:.0f} s"


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = bench_parser(PROG, __doc__)
    parser.add_argument("--sizes", default="qwen3-4b,qwen3-32b,hybrid-27b")
    parser.add_argument("--dtypes", default="bf16,8bit,4bit")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--depths", default="1,2,3,4,5")
    parser.add_argument("--decode-tokens", type=int, default=48)
    parser.add_argument("--cycles", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--small-m-kernel", action="store_true",
                        help="also time the quantized forwards with the small-M CUDA kernel")
    parser.add_argument("--small-m-loops", action="store_true",
                        help="with --small-m-kernel: also time decode and cycles with the kernel")
    parser.add_argument("--decode-vector-values", default="",
                        help="with --small-m-loops: greedy decode again with the vector layout's decode "
                             "threshold at each of these weight counts (comma-separated)")
    parser.add_argument("--attention-forms", default="",
                        help="with --small-m-loops or --decode-only: greedy decode and the depth-3 cycle "
                             "again with the fused loops' attention in each of these forms "
                             "(MTPLX_BUFFER_ATTENTION values, comma-separated: auto, one-pass, split, "
                             "two-pass, mma, 0; +pool after one: the loops' scalars in MLX's pool; +in_place, "
                             "+bias_once, +hoist, +mma_decode, +persistent: the small-M kernel's forms of those "
                             "names), "
                             "two rounds")
    parser.add_argument("--kernel-decode-from", default=None,
                        help="with --small-m-kernel: decode steps take the vector layout from this many "
                             "weights a matrix for the whole run, or `never` (verify rows only)")
    parser.add_argument("--divergence-tokens", type=int, default=0,
                        help="also run greedy AR and greedy MTP this many tokens through the engine's "
                             "loops (the kernel as served) and report every divergence")
    parser.add_argument("--divergence-depth", type=int, default=3)
    parser.add_argument("--divergence-limit", type=int, default=DIVERGENCE_LIMIT,
                        help="divergences to locate (MTP resynchronised after each) before stopping")
    parser.add_argument("--prefill-tokens", type=int, default=0,
                        help="also time a prefill of this many tokens (a hybrid's GDN layers both ways)")
    parser.add_argument("--decode-only", action="store_true",
                        help="the decode figures alone: no forwards, cycles or divergence")
    parser.add_argument("--cycle-temperatures", default="0,0.6",
                        help="temperatures the cycles are timed at (decode runs at 0 and 0.6)")
    parser.add_argument("--gdn-chunked", action="store_true",
                        help="a hybrid's verifies and prompts in the chunked GDN form on any backend, "
                             "as on CUDA (a CPU reproduces the GPU's divergences)")
    parser.add_argument("--row-invariant", action="store_true",
                        help="wherever the small-M kernel is installed, 1..7 rows on its tensor-core "
                             "layout, decode steps included (a verify row rounds as a decode step)")
    parser.add_argument("--row-invariant-beside", action="store_true",
                        help="with --small-m-kernel: time the kernel's figures a second time with "
                             "row-invariant routing in the same process (keys ending in _row_invariant)")
    parser.add_argument("--mma-configs", default="",
                        help="with --small-m-kernel: the kernel's figures again with its mma layout at each "
                             "WARPSxGROUPS[sSTAGES] (warps a block, groups a lane loads before use, "
                             "stages of shared memory it is pipelined through), e.g. 4x4,4x2,8x4s2")
    parser.add_argument("--kv-write-beside", action="store_true",
                        help="with --small-m-kernel: the kernel's figures again with the fused loops' "
                             "caches written by slice_update, not the served scatter (keys ending in "
                             "_slice_update)")
    parser.add_argument("--stacked", action="store_true",
                        help="with --small-m-kernel: last, the projections that read one input stacked "
                             "into one product and the kernel's figures timed again (keys ending in _stacked)")
    parser.add_argument("--qk-norm-rope", action="store_true",
                        help="every figure with the query and key norms and rope as one kernel a layer "
                             "(qk_norm_rope.py)")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args(argv)
    cycle_temperatures = tuple(float(t) for t in args.cycle_temperatures.split(","))
    if not set(cycle_temperatures) <= set(TEMPERATURES):
        parser.error(f"--cycle-temperatures: choose from {', '.join(map(str, TEMPERATURES))}")
    sizes = [s for s in args.sizes.split(",") if s]
    dtypes = [d for d in args.dtypes.split(",") if d]
    unknown = [s for s in sizes if s not in SIZES] + [d for d in dtypes if d not in DTYPES]
    if unknown:
        parser.error(f"unknown size or dtype: {', '.join(unknown)} (sizes: {', '.join(SIZES)}; "
                     f"dtypes: {', '.join(DTYPES)})")
    from mtplxd.engine.decoding.buffer_attention import AUTO, FORMS

    for form in _attention_forms(args):
        name, *modifiers = form.split("+")
        if name not in {"0", AUTO, *FORMS} or not set(modifiers) <= set(FORM_MODIFIERS):
            parser.error(f"--attention-forms: choose from 0, {AUTO}, {', '.join(FORMS)} (each may go "
                         f"on with +{', +'.join(FORM_MODIFIERS)})")
    depths = [int(d) for d in args.depths.split(",") if d]
    report: dict[str, Any] = {"configs": [], **machine(), "context": args.context,
                              "profile": list(PROFILE), "bandwidth_bytes_per_s": BANDWIDTH_BYTES_PER_S,
                              "command": command_line(PROG, argv),
                              "kernel_decode_from": args.kernel_decode_from,
                              "row_invariant": args.row_invariant}
    threshold = None  # the shipped one
    if args.kernel_decode_from is not None:
        threshold = sys.maxsize if args.kernel_decode_from == "never" else int(args.kernel_decode_from)
    from mtplxd.engine.model import gdn_chunked

    gdn_chunked.force(True if args.gdn_chunked else None)
    try:
        with decode_vector_threshold(threshold):
            _measure_all(args, sizes, dtypes, depths, cycle_temperatures, report)
    finally:
        gdn_chunked.force(None)
    if args.json_out:
        print(f"saved {args.json_out}")
    return 0


def _measure_all(args: Any, sizes: list[str], dtypes: list[str], depths: list[int],
                 cycle_temperatures: tuple[float, ...], report: dict[str, Any]) -> None:
    """Every size and dtype in turn, the report rewritten after each."""
    for size in sizes:
        for dtype in dtypes:
            entry = measure_config(size, dtype, context=args.context, depths=depths,
                                   decode_tokens=args.decode_tokens, cycles=args.cycles,
                                   repeats=args.repeats, small_m_kernel=args.small_m_kernel,
                                   cycle_temperatures=cycle_temperatures,
                                   kernel_loops=args.small_m_loops,
                                   decode_vector_values=tuple(
                                       int(v) for v in args.decode_vector_values.split(",") if v),
                                   divergence_tokens=args.divergence_tokens,
                                   divergence_depth=args.divergence_depth,
                                   divergence_limit=args.divergence_limit,
                                   # A weight count asks for decode steps on the kernel, even
                                   # where decode_wanted would leave them on MLX (8-bit).
                                   kernel_decode=(None if args.kernel_decode_from is None
                                                  else args.kernel_decode_from != "never"),
                                   decode_only=args.decode_only, prefill_tokens=args.prefill_tokens,
                                   row_invariant=args.row_invariant,
                                   row_invariant_beside=args.row_invariant_beside,
                                   mma_configs=parse_mma_configs(args.mma_configs),
                                   kv_write_beside=args.kv_write_beside, stacked=args.stacked,
                                   attention_forms=_attention_forms(args), qk_norm_rope=args.qk_norm_rope)
            # The model died with measure_config's frame: free it before the next is built.
            gc.collect()
            mx.clear_cache()
            report["configs"].append(entry)
            print(_summary_line(entry), flush=True)
            if args.json_out:  # after every config: a run cut short keeps what it measured
                write_report(args.json_out, report)


if __name__ == "__main__":
    sys.exit(main())
