"""What a verify costs on this device, and whether greedy MTP reproduces AR here.

    python -m mtplxd.engine.bench.verify [--dims qwen3-4b] [--dtype bfloat16] [--context 512]
        [--max-depth 5] [--json-out FILE]

Builds a random-weight dense qwen3 of the given dimensions in memory (no checkpoint needed),
with a random MTP head, and measures:
  * one decode step (1 token) and one verify (K+1 tokens, K = 1..max-depth) at a fixed
    context: the cache is trimmed back after each call, so every timed call has the same
    shapes (a compiled kernel set is reused, as in the engine's steady state);
  * one full speculative cycle at depth K (K chained head steps + the verify + accept);
    with `cycle_ms / decode_ms = c`, MTP beats AR once tokens per cycle exceed c; again
    with a 4-bit copy of lm_head for drafting (`Trunk.quantize_draft_head`);
  * greedy AR against greedy MTP token by token, and at the first divergence the gap
    between the AR step's two best logits (a near-tie when it is within rounding).
Medians over `--repeats` timed calls after warm-up.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, Iterable

import mlx.core as mx

from mtplxd.engine.bench.harness import (
    bench_parser, command_line, device_name, median_ms, print_and_save,
)

PROG = "python -m mtplxd.engine.bench.verify"

DIMS: dict[str, dict[str, Any]] = {
    # Qwen/Qwen3-4B (config.json of the release): 36 layers, hidden 2560, GQA 32/8 x 128.
    "qwen3-4b": dict(hidden_size=2560, num_hidden_layers=36, intermediate_size=9728,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 vocab_size=512, tie_word_embeddings=True),
}


def build_random_model(dims: str, dtype: mx.Dtype, seed: int = 0):
    """(mlx-lm qwen3 Model with an `.mtp` MTPHead, its config) with random weights in `dtype`."""
    from mlx_lm.models import qwen3

    from mtplxd.engine.model.families import get_family
    from mtplxd.engine.model.mtp_head import MTPHead

    config = dict(model_type="qwen3", rms_norm_eps=1e-6, max_position_embeddings=40960,
                  rope_theta=1000000.0, **DIMS[dims])
    mx.random.seed(seed)
    args = qwen3.ModelArgs.from_dict(config)
    model = qwen3.Model(args)
    model.mtp = MTPHead(args.hidden_size, args.rms_norm_eps, get_family("qwen3").build_mtp_layer(args))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model, config


def measure_forward_costs(trunk, cache, vocab: int, max_depth: int, repeats: int, *,
                          token_counts: Iterable[int] | None = None) -> dict[str, float]:
    """Median ms of a trunk forward over T = 1..max_depth+1 tokens (or `token_counts`) at the
    cache's context; the cache is trimmed back after each call."""
    costs = {}
    for tokens in token_counts or range(1, max_depth + 2):
        block = mx.random.randint(0, vocab, (1, tokens))

        def call(block=block, tokens=tokens):
            hidden, logits = trunk.forward(block, cache, all_logits=True)
            mx.eval(hidden, logits)
            for entry in cache:
                entry.trim(tokens)

        costs[str(tokens)] = median_ms(call, repeats)
    return costs


def measure_pipelined_forward_costs(trunk, cache, vocab: int, token_counts: Iterable[int],
                                    steps: int, warmup: int = 3) -> dict[str, float]:
    """ms per trunk forward of T tokens when forwards run back to back as the decode loops
    run theirs: each is built and handed to the device before the one before it finishes
    (the cache trimmed back after each, lazily), so the host's graph building overlaps the
    device. A decode step is pipelined so; `measure_forward_costs`' synchronous forwards are
    not, and on a host-bound GPU step they count the host's time on top of the device's."""
    costs = {}
    for tokens in token_counts:
        block = mx.random.randint(0, vocab, (1, tokens))

        def launch(block=block, tokens=tokens) -> mx.array:
            _, logits = trunk.forward(block, cache, all_logits=True)
            for entry in cache:
                entry.trim(tokens)
            mx.async_eval(logits)
            return logits

        costs[str(tokens)] = back_to_back_ms(launch, steps, warmup)
    return costs


def back_to_back_ms(launch: Callable[[], mx.array], steps: int, warmup: int) -> float:
    """ms per call of `launch` (which hands one forward to the device and returns its output)
    over `steps` calls in a row, each launched before the last finishes, after `warmup`
    calls run to the end."""
    for _ in range(warmup):
        mx.eval(launch())
    start = time.perf_counter()
    for _ in range(steps):
        last = launch()
    mx.eval(last)
    return (time.perf_counter() - start) * 1000 / steps


def compiled_forward(trunk, cache, most_tokens: int) -> tuple[Callable, list[mx.array], mx.array] | None:
    """A trunk forward compiled over fixed KV buffers, as the fused MTP loop's verify runs:
    (step, buffers, n) where step(tokens (1, T), n, *buffers) -> (logits (1, T, V), *buffers
    with the T rows written at n), `buffers` copies of `cache`'s rows with room for
    `most_tokens` more, and n its length as a device int. Called again with its own buffers at
    the same n it writes the same slots. None where the fused loops do not take the cache
    (a hybrid's recurrent state)."""
    from mtplxd.engine.decoding.fused import (
        buffers_of, capacity_for, fused_supported, route_static_cache_attention, static_caches, to_buffers,
    )

    if not fused_supported(trunk, cache):
        return None
    route_static_cache_attention()
    length = cache[0].offset

    def forward(tokens: mx.array, n: mx.array, *buffers: mx.array) -> tuple[mx.array, ...]:
        caches = static_caches(list(buffers), n)
        logits = trunk.lm_head(trunk.body(tokens, caches))
        return (logits, *buffers_of(caches))

    return mx.compile(forward), to_buffers(cache, capacity_for(length + most_tokens + 1)), mx.array(length, mx.int32)


def measure_compiled_forward_costs(trunk, cache, vocab: int, token_counts: Iterable[int],
                                   steps: int, warmup: int = 3) -> dict[str, float]:
    """ms per trunk forward of T tokens compiled over fixed buffers (`compiled_forward`), run
    back to back as the fused loop runs its cycles, each handed to the device before the last
    finishes: the verify as the engine serves it, where `measure_pipelined_forward_costs`
    times mlx-lm's op-by-op forward. Inside an MTP cycle's routing (small_m_qmm's
    `marked_as_cycle`: layers routed row-invariantly in cycles are so here). {} where the
    fused loops do not take the cache. `cache` itself is left as it was."""
    from mtplxd.engine.model import small_m_qmm

    counts = list(token_counts)
    built = compiled_forward(trunk, cache, max(counts))
    if built is None:
        return {}
    step, buffers, n = built
    costs = {}
    with small_m_qmm.marked_as_cycle():
        for tokens in counts:
            block = mx.random.randint(0, vocab, (1, tokens))

            def launch(block=block) -> mx.array:
                nonlocal buffers
                logits, *buffers = step(block, n, *buffers)  # the old buffers go: written in place
                mx.async_eval(logits)
                return logits

            costs[str(tokens)] = back_to_back_ms(launch, steps, warmup)
    return costs


def measure_ar_step(trunk, cache, params, repeats: int) -> float:
    """Median ms of one AR step (1-token forward + picking the token) at a fixed context."""
    from mtplxd.engine.decoding.sampling import TARGET, pick, position_key

    def step():
        _, logits = trunk.forward(mx.array([[7]]), cache, all_logits=True)
        keys = None if params.greedy else [position_key(0, cache[0].offset, TARGET)]
        mx.eval(pick(logits[0], params, None, None, keys))
        for entry in cache:
            entry.trim(1)

    return median_ms(step, repeats)


def measure_sampling_ops(vocab: int, depth: int, repeats: int) -> dict[str, float]:
    """Median ms of the sampling pieces alone on random logits (1 or depth+1 rows of vocab)."""
    from mtplxd.engine.decoding.sampling import DRAFT, position_key, probabilities, scaled_logits
    from mtplxd.engine.interface import SamplingParams

    params = SamplingParams(temperature=0.6, top_p=0.95)
    row = mx.random.normal((1, vocab))
    rows = mx.random.normal((depth + 1, vocab))
    mx.eval(row, rows)
    plain = SamplingParams(temperature=0.6)
    return {
        "argmax_1row": median_ms(lambda: mx.eval(mx.argmax(row, axis=-1)), repeats),
        "scaled_logits_top_p_1row": median_ms(lambda: mx.eval(scaled_logits(row, params)), repeats),
        "scaled_logits_no_filter_1row": median_ms(lambda: mx.eval(scaled_logits(row, plain)), repeats),
        "categorical_1row": median_ms(lambda: mx.eval(mx.random.categorical(
            row, key=position_key(0, 1, DRAFT))), repeats),
        "probabilities_top_p_k+1_rows": median_ms(lambda: mx.eval(probabilities(rows, params, None, None)),
                                                   repeats),
        "argsort_1row": median_ms(lambda: mx.eval(mx.argsort(row, axis=-1)), repeats),
    }


def measure_draft_cost(trunk, head, prompt: list[int], hiddens, depth: int, repeats: int,
                       params) -> float:
    """Median ms of the K chained drafts alone (head steps, draft logits and picks)."""
    from mtplxd.engine.decoding.sampling import TokenHistory
    from mtplxd.engine.decoding.speculative import SpeculativeDecoder

    vocab = trunk.text.model.embed_tokens.weight.shape[0]
    decoder = SpeculativeDecoder(trunk, head, trunk.make_cache(), params, TokenHistory(vocab, prompt),
                                 seed=0, depth=depth)
    pending_h = mx.concatenate(hiddens, axis=1)
    decoder._first_draft_hidden(pending_h, prompt[1:] + [prompt[0]])
    last = pending_h[:, -1:]

    def draft():
        start = decoder.head_cache[0].offset
        drafts, q_rows = decoder._draft(len(prompt), last, [prompt[-1]])
        mx.eval(drafts, q_rows)
        for entry in decoder.head_cache:
            entry.trim(entry.offset - start)

    return median_ms(draft, repeats)


def measure_cycle_costs(trunk, head, cache, prompt: list[int], hiddens, max_depth: int,
                        repeats: int, params=None) -> dict[str, float]:
    """Median ms of one whole speculative cycle at each depth (drafts, verify, accept, commit);
    greedy unless `params` says otherwise."""
    from mtplxd.engine.decoding.sampling import TokenHistory
    from mtplxd.engine.decoding.speculative import SpeculativeDecoder
    from mtplxd.engine.interface import SamplingParams

    params = params or SamplingParams()
    costs = {}
    base = cache[0].offset
    for depth in range(1, max_depth + 1):
        decoder = SpeculativeDecoder(trunk, head, cache, params, TokenHistory(
            trunk.text.model.embed_tokens.weight.shape[0], prompt), seed=0, depth=depth)
        pending_h = mx.concatenate(hiddens, axis=1)
        pending_tokens = prompt[1:] + [prompt[0]]
        decoder._first_draft_hidden(pending_h, pending_tokens)  # the head's cache over the prompt
        mx.eval([c.state for c in decoder.head_cache])
        last = pending_h[:, -1:]

        def cycle(decoder=decoder, last=last):
            n = cache[0].offset
            accepted, committed, hidden = decoder._cycle(n, prompt[-1], last, [prompt[-1]])
            mx.eval(hidden)
            extra = cache[0].offset - base  # back to the same context: equal shapes every time
            for entry in cache:
                entry.trim(extra)
            for entry in decoder.head_cache:
                entry.trim(entry.offset - len(prompt))

        costs[str(depth)] = median_ms(cycle, repeats)
    return costs


def greedy_agreement(trunk, head, prompt: list[int], vocab: int, depth: int, tokens: int) -> dict[str, Any]:
    """Greedy AR and greedy MTP side by side: agreement and the first divergence's logit gap."""
    from mtplxd.engine.decoding.autoregressive import ar_cycles
    from mtplxd.engine.decoding.sampling import TokenHistory, pick
    from mtplxd.engine.decoding.speculative import SpeculativeDecoder
    from mtplxd.engine.interface import SamplingParams

    params = SamplingParams()

    def run(use_mtp: bool) -> tuple[list[int], float, int]:
        cache = trunk.make_cache()
        hiddens, logits = trunk.prefill(prompt, cache)
        first = pick(logits[None], params, None, None, None).item()
        history = TokenHistory(vocab, prompt)
        if use_mtp:
            cycles = SpeculativeDecoder(trunk, head, cache, params, history, 0, depth).cycles(hiddens, prompt, first)
        else:
            cycles = ar_cycles(trunk, cache, params, history, 0, first, len(prompt))
        out = [first]
        steps = 0
        start = time.perf_counter()
        while len(out) < tokens:
            out += next(cycles)
            steps += 1
        elapsed = time.perf_counter() - start
        cycles.close()
        return out[:tokens], elapsed, steps

    # First runs meet every context length for the first time (as a new, longer conversation
    # does); second runs replay lengths whose kernels exist. A large gap means recompiles.
    (_, ar_cold, ar_cold_steps), (_, mtp_cold, mtp_cold_steps) = run(False), run(True)
    (ar, ar_s, ar_steps), (mtp, mtp_s, mtp_steps) = run(False), run(True)
    report: dict[str, Any] = {"tokens": tokens, "depth": depth, "identical": ar == mtp,
                              "first_run_ar_ms_per_step": 1000 * ar_cold / ar_cold_steps,
                              "first_run_mtp_ms_per_cycle": 1000 * mtp_cold / mtp_cold_steps,
                              # The real loops, context growing as in serving (not trimmed back).
                              "ar_ms_per_step": 1000 * ar_s / ar_steps,
                              "mtp_ms_per_cycle": 1000 * mtp_s / mtp_steps,
                              "mtp_tokens_per_cycle": (tokens - 1) / mtp_steps,
                              "decode_tokens_per_second_ar": (tokens - 1) / ar_s,
                              "decode_tokens_per_second_mtp": (tokens - 1) / mtp_s}
    report.update(first_divergence(trunk, prompt, ar, mtp))
    return report


def first_divergence(trunk, prompt: list[int], ar: list[int], mtp: list[int]) -> dict[str, Any]:
    """Where greedy MTP's tokens first leave greedy AR's after `prompt` (None: they do not),
    and there the AR step's gap between its two best logits and the MTP token's logit below
    the AR token's: a near-tie when within the dtype's rounding."""
    diverged = next((i for i, (a, b) in enumerate(zip(ar, mtp)) if a != b), None)
    report: dict[str, Any] = {"first_divergence": diverged}
    if diverged is not None:
        report.update(logit_gaps(trunk, prompt, ar, diverged, mtp[diverged]))
    return report


def logit_gaps(trunk, prompt: list[int], ar: list[int], position: int, other: int) -> dict[str, float]:
    """At `position` of AR's tokens `ar` after `prompt`: the gap between the two best logits
    and the `other` token's logit below AR's token's, from a prefill of everything before."""
    _, logits = trunk.prefill(prompt + ar[:position], trunk.make_cache())
    logits = logits.reshape(-1).astype(mx.float32)
    top = mx.sort(logits)[-2:].tolist()
    return {"ar_top2_gap_at_divergence": top[1] - top[0],
            "mtp_token_logit_gap": (logits[ar[position]] - logits[other]).item()}


def _greedy_both_caches(trunk, head, prompt: list[int], vocab: int, tokens: int) -> dict[str, Any]:
    """greedy_agreement with mlx-lm's KVCache and with BucketedKVCache (fixed shapes)."""
    default = trunk.fixed_shapes
    report = {}
    for fixed in (False, True):
        trunk.fixed_shapes = fixed
        report["bucketed_kv" if fixed else "plain_kv"] = greedy_agreement(trunk, head, prompt, vocab, 3, tokens)
    trunk.fixed_shapes = default
    return report


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = bench_parser(PROG, __doc__)
    parser.add_argument("--dims", choices=sorted(DIMS), default="qwen3-4b")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--context", type=int, default=512, help="prompt tokens before timing")
    parser.add_argument("--max-depth", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--greedy-tokens", type=int, default=64)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)

    from mtplxd.engine.model.families import get_family
    from mtplxd.engine.model.trunk import Trunk

    started = time.perf_counter()
    model, config = build_random_model(args.dims, getattr(mx, args.dtype))
    trunk = Trunk(model, get_family("qwen3"))
    vocab = config["vocab_size"]
    prompt = mx.random.randint(0, vocab, (args.context,), key=mx.random.key(1)).tolist()
    cache = trunk.make_cache()
    hiddens, _ = trunk.prefill(prompt, cache)
    build_seconds = time.perf_counter() - started

    forward = measure_forward_costs(trunk, cache, vocab, args.max_depth, args.repeats)
    cycles = measure_cycle_costs(trunk, model.mtp, cache, prompt, hiddens, args.max_depth, args.repeats)
    decode = forward["1"]
    from mtplxd.engine.interface import SamplingParams

    sampled = SamplingParams(temperature=0.6, top_p=0.95)
    ar_step_sampled = measure_ar_step(trunk, cache, sampled, args.repeats)
    cycles_sampled = measure_cycle_costs(trunk, model.mtp, cache, prompt, hiddens, args.max_depth,
                                         args.repeats, sampled)
    drafts_greedy = measure_draft_cost(trunk, model.mtp, prompt, hiddens, 3, args.repeats, SamplingParams())
    drafts_sampled = measure_draft_cost(trunk, model.mtp, prompt, hiddens, 3, args.repeats, sampled)
    quantized_draft = trunk.quantize_draft_head(bits=4, group_size=min(64, config["hidden_size"]))
    cycles_q4 = (measure_cycle_costs(trunk, model.mtp, cache, prompt, hiddens, args.max_depth, args.repeats)
                 if quantized_draft else {})
    report = {
        "device": device_name(),
        "device_info": {k: str(v) for k, v in mx.device_info().items()} if hasattr(mx, "device_info") else {},
        "mlx_version": mx.__version__,
        "dims": args.dims, "dtype": args.dtype, "context": args.context,
        "build_seconds": build_seconds,
        "forward_ms_by_tokens": forward,
        "verify_over_decode_by_depth": {str(k): forward[str(k + 1)] / decode for k in range(1, args.max_depth + 1)},
        "cycle_ms_by_depth": cycles,
        "cycle_over_decode_by_depth": {k: v / decode for k, v in cycles.items()},
        "ar_step_ms_greedy": measure_ar_step(trunk, cache, SamplingParams(), args.repeats),
        "sampling_ops_ms": measure_sampling_ops(vocab, 3, args.repeats),
        "draft_ms_depth3_greedy": drafts_greedy,
        "draft_ms_depth3_sampled": drafts_sampled,
        "ar_step_ms_sampled_t0.6_top_p0.95": ar_step_sampled,
        "cycle_ms_by_depth_sampled_t0.6_top_p0.95": cycles_sampled,
        "cycle_ms_by_depth_q4_draft_head": cycles_q4,
        "cycle_over_decode_by_depth_q4_draft_head": {k: v / decode for k, v in cycles_q4.items()},
        "greedy": _greedy_both_caches(trunk, model.mtp, prompt[:64], vocab, args.greedy_tokens),
        "command": command_line(PROG, argv),
    }
    return print_and_save(report, args.json_out)


if __name__ == "__main__":
    sys.exit(main())
