"""What single ops cost on this device, by row count: the kernels a verify and a draft use.

    python -m mtplxd.engine.bench.ops OUT.json [mm,qdtype,sdpa,norm,samp,big,prefill]

Each figure is the median time per op of a chain of ops evaluated together (after warm-up),
so on a GPU it is the op's launch and run time, not a host round trip. Sections: bf16 and
quantized matmuls at 1-8 rows ("mm"), quantized products of 1 and 4 rows with bfloat16 and
with float32 scales and inputs beside the dense ones ("qdtype": what the Linux CPU computes a
quantized checkpoint in), attention over a 512-slot buffer with and without
masks, and on CUDA through the fused cycle's buffer kernel ("sdpa"), rms_norm and rope
("norm"), the sampling pieces over an 8192 vocabulary ("samp"), a training-sized matmul
in float32 and bfloat16 ("big"), and one prefill chunk's attention taken apart ("prefill":
512 queries against 4,608 keys in float32, as the Linux CPU computes, through
mx.fast.scaled_dot_product_attention and through each step its CPU fallback runs, plus one
elementwise add and one exp over the same scores for scale).
"""

from __future__ import annotations

import math
import sys
from typing import Callable

import mlx.core as mx

from mtplxd.engine.bench.harness import device_name, median_ms, write_report
from mtplxd.engine.decoding import buffer_attention
from mtplxd.engine.decoding.sampling import scaled_logits
from mtplxd.engine.interface import SamplingParams

SECTIONS = ("mm", "qdtype", "sdpa", "norm", "samp", "big", "prefill")


def per_op_us(build: Callable[[int], object], n: int = 32, repeats: int = 20) -> float:
    """Median microseconds per op, where build(n) returns the lazy result of n chained ops."""
    return median_ms(lambda: mx.eval(build(n)), repeats) / n * 1000


def _matmuls(record) -> None:
    dt = mx.bfloat16
    for (n_out, n_in) in ((384, 384), (1024, 384), (384, 1024)):
        w = (mx.random.normal((n_out, n_in)) * 0.05).astype(dt)
        w_back = (mx.random.normal((n_in, n_out)) * 0.05).astype(dt)
        mx.eval(w, w_back)
        for rows in (1, 2, 3, 4, 5, 8):
            x = mx.random.normal((rows, n_in)).astype(dt)
            mx.eval(x)

            def dense(n, x=x, w=w, w_back=w_back):
                y = x
                for _ in range(n // 2):
                    y = (y @ w.T) @ w_back.T
                return y
            record(f"matmul bf16 {n_in}->{n_out} M={rows}", per_op_us(dense))
            for bits in (4, 8):
                q = mx.quantize(w, 64, bits)
                q_back = mx.quantize(w_back, 64, bits)
                mx.eval(q, q_back)

                def quantized(n, x=x, q=q, q_back=q_back, bits=bits):
                    y = x
                    for _ in range(n // 2):
                        y = mx.quantized_matmul(y, *q, transpose=True, group_size=64, bits=bits)
                        y = mx.quantized_matmul(y, *q_back, transpose=True, group_size=64, bits=bits)
                    return y
                record(f"qmatmul q{bits} {n_in}->{n_out} M={rows}", per_op_us(quantized))


def _attention(record) -> None:
    dt, slots, valid = mx.bfloat16, 512, 300
    k = mx.random.normal((1, 2, slots, 64)).astype(dt)
    v = mx.random.normal((1, 2, slots, 64)).astype(dt)
    mx.eval(k, v)
    for rows in (1, 2, 3, 4, 5, 7):
        q = mx.random.normal((1, 6, rows, 64)).astype(dt)
        bool_mask = mx.arange(slots)[None, :] <= (valid + mx.arange(rows))[:, None]
        additive = mx.where(bool_mask, 0.0, -1e9).astype(dt)
        mx.eval(q, bool_mask, additive)
        for name, mask in (("none", None), ("bool", bool_mask), ("additive", additive)):
            def attend(n, q=q, mask=mask):
                y = q
                for _ in range(n):
                    y = mx.fast.scaled_dot_product_attention(y, k, v, scale=0.125, mask=mask)
                return y
            record(f"sdpa q={rows} kv={slots} mask={name}", per_op_us(attend))
        if buffer_attention.usable():  # the fused cycle's kernel on CUDA
            def attend_buffer(n, q=q):
                y = q
                for _ in range(n):
                    y = buffer_attention.buffer_attention(y, k, v, mx.array(valid, mx.int32), 0.125)
                return y
            record(f"buffer attention kernel q={rows} kv={slots}", per_op_us(attend_buffer))
        k_exact, v_exact = k[:, :, :valid + rows], v[:, :, :valid + rows]
        mx.eval(k_exact, v_exact)

        def attend_exact(n, q=q, rows=rows):
            y = q
            for _ in range(n):
                y = mx.fast.scaled_dot_product_attention(y, k_exact, v_exact, scale=0.125,
                                                         mask="causal" if rows > 1 else None)
            return y
        record(f"sdpa q={rows} kv={valid + rows} exact causal", per_op_us(attend_exact))


def _norms(record) -> None:
    dt = mx.bfloat16
    weight = mx.ones((384,), dt)
    for rows in (1, 4):
        x = mx.random.normal((1, rows, 384)).astype(dt)
        heads = mx.random.normal((1, 6, rows, 64)).astype(dt)
        mx.eval(x, heads)

        def norms(n, y=x):
            for _ in range(n):
                y = mx.fast.rms_norm(y, weight, 1e-6)
            return y

        def ropes(n, y=heads):
            for _ in range(n):
                y = mx.fast.rope(y, 64, traditional=False, base=10000.0, scale=1.0, offset=300)
            return y
        record(f"rms_norm M={rows}", per_op_us(norms))
        record(f"rope M={rows}", per_op_us(ropes))


def _sampling(record) -> None:
    vocab, key = 8192, mx.random.key(0)
    top_p = SamplingParams(temperature=0.6, top_p=0.95)
    plain = SamplingParams(temperature=0.6, top_p=1.0)
    pieces = {
        "argmax": lambda x: mx.argmax(x, -1),
        "argsort": lambda x: mx.argsort(-x, -1),
        "sort": lambda x: mx.sort(x, -1),
        "cumsum": lambda x: mx.cumsum(x, -1),
        "logsumexp": lambda x: mx.logsumexp(x, -1, keepdims=True),
        "put_along_axis": lambda x: mx.put_along_axis(mx.zeros_like(x), mx.argsort(x, -1), x, -1),
        "categorical": lambda x: mx.random.categorical(x, key=key),
        "scaled_logits top-p": lambda x: scaled_logits(x, top_p),
        "scaled_logits plain": lambda x: scaled_logits(x, plain),
        "draw top-p": lambda x: mx.random.categorical(scaled_logits(x, top_p), key=key),
        "draw plain": lambda x: mx.random.categorical(scaled_logits(x, plain), key=key),
    }
    for rows in (1, 5):
        logits = mx.random.normal((rows, vocab))
        mx.eval(logits)
        for name, fn in pieces.items():
            compiled = mx.compile(fn)
            record(f"{name} [{rows},{vocab}] compiled, alone",
                   per_op_us(lambda n, c=compiled: [c(logits) for _ in range(n)], n=8))


def _quantized_by_dtype(record, shapes=((4096, 2560), (2560, 9728)), rows=(1, 4)) -> None:
    """1 and 4 rows (a decode step, a depth-3 verify) through a quantized matrix of a 4B
    model's size (q_proj, down_proj), its scales, biases and input in bfloat16 (as a quantized
    checkpoint ships) and in float32 (as the Linux CPU serves it), beside the same matrix dense
    in float32 and bfloat16: the activations' dtype sets what MLX's CPU quantized matmul
    computes in, and its rows each cost a pass."""
    for n_out, n_in in shapes:
        w = mx.random.normal((n_out, n_in)) * 0.02
        quantized = {bits: mx.quantize(w.astype(mx.bfloat16), 64, bits) for bits in (4, 8)}
        for m in rows:
            x = mx.random.normal((m, n_in))
            for bits, (packed, scales, biases) in quantized.items():
                for dt in (mx.bfloat16, mx.float32):
                    args = (x.astype(dt), packed, scales.astype(dt), biases.astype(dt))
                    mx.eval(*args)
                    record(f"qmatmul q{bits} {n_in}->{n_out} M={m} {dt}", per_op_us(
                        lambda n, a=args, b=bits: [
                            mx.quantized_matmul(*a, transpose=True, group_size=64, bits=b) for _ in range(n)],
                        n=4, repeats=5))
            for dt in (mx.bfloat16, mx.float32):
                dense, row = w.astype(dt), x.astype(dt)
                mx.eval(dense, row)
                record(f"matmul {n_in}->{n_out} M={m} dense {dt}",
                       per_op_us(lambda n, a=row, d=dense: [a @ d.T for _ in range(n)], n=4, repeats=5))


def _training_matmul(record) -> None:
    for dt in (mx.float32, mx.bfloat16):
        a = mx.random.normal((32768, 384)).astype(dt)
        b = mx.random.normal((384, 1024)).astype(dt)
        mx.eval(a, b)
        us = per_op_us(lambda n: [a @ b for _ in range(n)], n=8)
        record(f"training matmul 32768x384x1024 {dt} (TFLOP/s={2 * 32768 * 384 * 1024 / us / 1e6:.0f})", us)


def _prefill_attention(record, rows: int = 512, keys: int = 4096 + 512) -> None:
    # The embedded model's shapes: 4 query heads on 2 KV heads of 64, one 512-token chunk
    # after 4,096 cached tokens. Each op runs alone (n=1): one is already milliseconds.
    # "power" is exp as libm's powf(e, x), an alternative to MLX's own CPU exp.
    dt = mx.float32
    q = mx.random.normal((1, 4, rows, 64)).astype(dt)
    k = mx.random.normal((1, 2, keys, 64)).astype(dt)
    v = mx.random.normal((1, 2, keys, 64)).astype(dt)
    grouped_q = q.reshape(1, 2, 2 * rows, 64)  # both query heads of a KV head as one matmul
    scores = grouped_q @ k.swapaxes(-1, -2)
    causal = (mx.arange(keys - rows, keys)[:, None] >= mx.arange(keys)[None]).reshape(1, 1, rows, keys)
    weights = mx.softmax(scores, axis=-1)
    mx.eval(q, k, v, grouped_q, scores, causal, weights)
    shape = f"q={rows} kv={keys} f32"
    pieces = {
        f"prefill sdpa causal {shape}": lambda: mx.fast.scaled_dot_product_attention(
            q, k, v, scale=0.125, mask="causal"),
        f"prefill scores q@k^T {shape}": lambda: grouped_q @ k.swapaxes(-1, -2),
        f"prefill mask where {shape}": lambda: mx.where(causal, scores.reshape(1, 2, 2, rows, keys), -1e30),
        f"prefill softmax {shape}": lambda: mx.softmax(scores, axis=-1),
        f"prefill exp alone {shape}": lambda: mx.exp(scores),
        f"prefill power(e, x) alone {shape}": lambda: mx.power(mx.array(math.e, dt), scores),
        f"prefill add alone {shape}": lambda: scores + 1.0,
        f"prefill weights@v {shape}": lambda: weights @ v,
    }
    for name, fn in pieces.items():
        record(name, per_op_us(lambda n, fn=fn: [fn() for _ in range(n)], n=1, repeats=5))


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    sections = argv[1].split(",") if len(argv) > 1 else list(SECTIONS)
    results: dict[str, float] = {}

    def record(name: str, us: float) -> None:
        results[name] = round(us, 2)
        print(f"{name:60s} {us:9.2f} us", flush=True)

    x = mx.ones((1, 384), mx.bfloat16)
    mx.eval(x)

    def adds(n, y=x):
        for _ in range(n):
            y = y + 1
        return y
    record("elementwise add [1,384]", per_op_us(adds))
    runners = {"mm": _matmuls, "qdtype": _quantized_by_dtype, "sdpa": _attention, "norm": _norms,
               "samp": _sampling, "big": _training_matmul, "prefill": _prefill_attention}
    for name in sections:
        runners[name](record)
    write_report(argv[0], {"device": device_name(), "mlx_version": mx.__version__,
                           "us_per_op": results}, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
