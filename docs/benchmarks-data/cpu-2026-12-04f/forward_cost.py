"""Forward cost of 1..4 tokens of a random Qwen3 model at real dims on the Linux CPU, its
4-bit weights packed (float32 scales, as mtplx serves them with `dequantize = "off"`) against
the same weights dequantized to float32 (loader.dequantize, the default where they fit).

    python docs/benchmarks-data/cpu-2026-12-04f/forward_cost.py --size 0.6b --json-out FILE

Each figure is the median of `--repeats` synchronous forwards over a 64-token cache, trimmed
back after each; the two forms alternate forward by forward. A verify of K drafts is a forward
of K+1 tokens, so "rows 4 / rows 1" is what a depth-3 cycle's verify costs in decode steps.
"""

from __future__ import annotations

import argparse
import json
import time

import mtplxd.blas  # before MLX: it loads OpenBLAS where libmlx will bind to it
from mtplxd.engine.model.loader import dequantize, parameter_bytes

import mlx.core as mx  # noqa: E402  (after the BLAS)
import mlx.nn as nn  # noqa: E402

SIZES = {  # Qwen3's published dims (config.json of Qwen/Qwen3-0.6B and -1.7B)
    "0.6b": dict(hidden_size=1024, num_hidden_layers=28, intermediate_size=3072,
                 num_attention_heads=16, num_key_value_heads=8),
    "1.7b": dict(hidden_size=2048, num_hidden_layers=28, intermediate_size=6144,
                 num_attention_heads=16, num_key_value_heads=8),
}


def build(size: str):
    from mlx_lm.models import qwen3

    args = qwen3.ModelArgs(model_type="qwen3", head_dim=128, rms_norm_eps=1e-6, vocab_size=151936,
                           max_position_embeddings=40960, rope_theta=1e6, tie_word_embeddings=True,
                           **SIZES[size])
    model = qwen3.Model(args)
    model.set_dtype(mx.bfloat16)
    nn.quantize(model, group_size=64, bits=4)  # as mlx-community ships it: bfloat16 scales
    model.set_dtype(mx.float32)  # then as served on the Linux CPU (loader.compute_dtype)
    mx.eval(model.parameters())
    return model


def forward_ms(model, cache, rows: int) -> float:
    tokens = mx.array([[7] * rows])
    started = time.perf_counter()
    mx.eval(model(tokens, cache=cache))
    elapsed = time.perf_counter() - started
    for layer in cache:
        layer.trim(rows)
    return elapsed * 1000


def main() -> None:
    from mlx_lm.models.cache import make_prompt_cache

    parser = argparse.ArgumentParser()
    parser.add_argument("--size", choices=SIZES, default="0.6b")
    parser.add_argument("--rows", default="1,2,4")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json-out")
    args = parser.parse_args()
    blas = mtplxd.blas.activate()  # done by the engine import above; this reads the outcome
    mx.set_default_device(mx.cpu)
    packed = build(args.size)
    dense = build(args.size)
    packed_bytes = parameter_bytes(dense)
    dequantize(dense)
    forms = {"packed": packed, "dense": dense}
    caches = {}
    for name, model in forms.items():
        caches[name] = make_prompt_cache(model)
        mx.eval(model(mx.array([list(range(64))]), cache=caches[name]))
    rows = [int(r) for r in args.rows.split(",")]
    times: dict[str, dict[int, list[float]]] = {name: {r: [] for r in rows} for name in forms}
    for _ in range(args.repeats):
        for r in rows:
            for name, model in forms.items():
                times[name][r].append(forward_ms(model, caches[name], r))
    median = lambda xs: sorted(xs)[len(xs) // 2]
    if blas.kind != "openblas":
        raise SystemExit(f"no optimized BLAS in this process ({blas.summary()}): run `mtplxctl blas --install`")
    report = {"size": args.size, "blas": blas.kind, "repeats": args.repeats,
              "weights_bytes": {"packed": packed_bytes, "dense": parameter_bytes(dense)},
              "forward_ms": {name: {str(r): median(t) for r, t in by_rows.items()} for name, by_rows in times.items()},
              "runs_ms": {name: {str(r): t for r, t in by_rows.items()} for name, by_rows in times.items()}}
    for name in forms:
        one = report["forward_ms"][name]["1"]
        print(name, {r: f"{report['forward_ms'][name][str(r)]:.0f} ms ({report['forward_ms'][name][str(r)] / one:.2f}x)"
                     for r in rows})
    print("dense over packed, 1 row:", f"{report['forward_ms']['packed']['1'] / report['forward_ms']['dense']['1']:.2f}x faster")
    if args.json_out:
        with open(args.json_out, "w") as out:
            json.dump(report, out, indent=2)


if __name__ == "__main__":
    main()
