"""What GDN rollback costs: verify of K+1 tokens vs R1 `trim` (GDN replay) vs R0 (re-forward).

    python -m mtplxd.engine.bench.rollback [--family qwen3_5] [--depth 3] [--prompt 32]
        [--repeats 9] [--set KEY=JSON ...] [--json-out FILE]

Writes a random hybrid checkpoint (default: hidden 512, 8 layers of which 6 GDN, Hk/Hv 4/8,
Dk = Dv = 64; change any text-config key with --set) into a temp folder, prefills a prompt,
then for every accept count a = 0..K times one verify forward, R1 (`trim(K - a)` on every
cache) and R0 (`rollback_by_reforward`). Medians over repeats, in milliseconds. It runs on
whatever device MLX defaults to.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

from mtplxd.engine.bench.harness import elapsed_ms, median, write_report
from mtplxd.engine.fixtures.tiny_hybrid import write_tiny_hybrid_checkpoint
from mtplxd.engine.model.hybrid import HYBRID_MODEL_TYPES
from mtplxd.engine.model.rollback import make_rollback_cache, rollback_by_reforward

PROG = "python -m mtplxd.engine.bench.rollback"
DEFAULT_DIMS: dict[str, Any] = {
    "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8,
    "full_attention_interval": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
    "head_dim": 64, "linear_num_key_heads": 4, "linear_num_value_heads": 8,
    "linear_key_head_dim": 64, "linear_value_head_dim": 64,
}


def _sync(cache: list[Any]) -> None:
    mx.eval([c.state for c in cache])


def time_rollback(model: Any, prompt: mx.array, block: mx.array,
                  rollback: Callable[[list[Any]], Any], repeats: int) -> tuple[float, float]:
    """Median ms of (the verify forward of `block`, `rollback(cache)` right after it)."""
    verify, undo = [], []
    for _ in range(repeats):
        cache = make_rollback_cache(model)
        mx.eval(model(prompt, cache=cache))
        _sync(cache)
        verify.append(elapsed_ms(lambda: (mx.eval(model(block, cache=cache)), _sync(cache))))
        undo.append(elapsed_ms(lambda: (rollback(cache), _sync(cache))))
    return median(verify), median(undo)


def run(family: str, depth: int, prompt_tokens: int, repeats: int, dims: dict[str, Any]) -> dict[str, Any]:
    """Measure every accept count 0..depth; returns the report as a dict."""
    from mlx_lm.utils import load_model

    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_hybrid_checkpoint(Path(tmp), family, draft_friendly=False, **dims)
        model, _ = load_model(path)
    prompt = mx.array([[i % 400 for i in range(prompt_tokens)]])
    block = mx.array([[(7 * i + 1) % 400 for i in range(depth + 1)]])
    rows = []
    for accepted in range(depth + 1):
        verify, r1 = time_rollback(
            model, prompt, block, lambda c: [e.trim(depth - accepted) for e in c], repeats)
        _, r0 = time_rollback(
            model, prompt, block, lambda c: rollback_by_reforward(model, c, block, accepted + 1), repeats)
        rows.append({"accepted": accepted, "verify_ms": verify, "r1_trim_ms": r1, "r0_reforward_ms": r0})
    return {"family": family, "depth": depth, "prompt_tokens": prompt_tokens, "repeats": repeats,
            "device": str(mx.default_device()), "dims": dims, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen3_5", choices=HYBRID_MODEL_TYPES)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens before the verify")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                        help="text-config override, e.g. --set hidden_size=1024")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    dims = dict(DEFAULT_DIMS)
    for item in args.set:
        key, _, value = item.partition("=")
        dims[key] = json.loads(value)
    report = run(args.family, args.depth, args.prompt, args.repeats, dims)
    print(f"{report['family']} on {report['device']}, K={report['depth']}, "
          f"{report['prompt_tokens']}-token prompt, medians of {report['repeats']}")
    for row in report["rows"]:
        print(f"  accepted {row['accepted']}: verify {row['verify_ms']:.2f} ms | "
              f"R1 trim {row['r1_trim_ms']:.2f} ms | R0 restore+re-forward {row['r0_reforward_ms']:.2f} ms")
    if args.json_out:
        write_report(args.json_out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
