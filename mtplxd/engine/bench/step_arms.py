"""Whole decode steps of several configurations in one process, alternating: which one is
faster when the machine's own speed swings more than they differ (issue 22).

    python -m mtplxd.engine.bench.step_arms --size qwen3-4b --dtype 4bit \\
        --arms kernel,kernel+stacked+norm-rope [--rounds 4] [--steps 256] [--depth 0] \\
        [--context 512] --json-out arms.json

Why: a 4-bit Qwen3-4B's decode step is bound by the host (docs/benchmarks.md, "A kernel's host
cost"), and the same step took 4.0 to 6.2 ms in six processes on one machine. One process a
configuration (bench.step_profile) cannot see a 10% gain through that. Here each arm is timed
once a round, the arms in turn, for `--rounds` rounds, in one process: each round's ratio to
the first arm compares steps run seconds apart on the same host.

An arm is features joined by "+" ("stock" for none):
  kernel         the small-M kernel installed as served (small_m_qmm.install)
  row-invariant  with kernel: every 1..7-row product on its tensor-core layout, decode steps too
  mixed          with kernel: the mixed routing (layouts by row count) whatever is served (a
                 dense 8-bit 27B/32B-class model is served row-invariant since 2026-12-07)
  stacked        the projections that read one input as one product (stacked.py)
  norm-rope      the query and key norms and rope as one kernel a layer (qk_norm_rope.py)
  compiled-ar    the AR loop compiled (fused_ar.py) whatever fused_ar_wanted says
  op-by-op-ar    the AR loop op by op whatever fused_ar_wanted says
Arms that change the weights (stacked, norm-rope) get a model of their own (random weights
built the same way); the rest switch the kernel and the loop on one model between turns, the
kernel taken out and the compiled graphs dropped after each kernel arm's turn (a traced graph
keeps the routing it was traced with: real_size.kernel_installed).

Reported per arm: wall and process CPU ms a step of each round, their medians and tokens a
step; and each arm's ratio to the first arm, round by round and the median of those.
"""

from __future__ import annotations

import contextlib
import statistics
from pathlib import Path
from typing import Any

from mtplxd.engine.bench.harness import bench_parser, command_line, machine, write_report
from mtplxd.engine.bench.step_profile import build_for_steps, prompt_for, time_loop

PROG = "python -m mtplxd.engine.bench.step_arms"
FEATURES = ("kernel", "row-invariant", "mixed", "stacked", "norm-rope", "compiled-ar", "op-by-op-ar")
MODEL_FEATURES = frozenset({"stacked", "norm-rope"})  # these change the weights: a model each


def parse_arm(text: str) -> frozenset[str]:
    """An arm's features ("stock" alone: none); ValueError on an unknown or clashing one."""
    features = frozenset(part for part in text.split("+") if part and part != "stock")
    unknown = features - set(FEATURES)
    if unknown or not text:
        raise ValueError(f"arm {text!r}: unknown feature(s) {sorted(unknown)}; known: stock, {', '.join(FEATURES)}")
    if {"compiled-ar", "op-by-op-ar"} <= features:
        raise ValueError(f"arm {text!r}: compiled-ar and op-by-op-ar both")
    if {"row-invariant", "mixed"} <= features:
        raise ValueError(f"arm {text!r}: row-invariant and mixed both")
    for routing in ("row-invariant", "mixed"):
        if routing in features and "kernel" not in features:
            raise ValueError(f"arm {text!r}: {routing} routes the kernel: add kernel")
    return features


def run_arms(size: str, dtype: str, arms: list[str], *, depth: int = 0, steps: int = 256,
             rounds: int = 4, context: int = 512, warmup: int = 8) -> dict[str, Any]:
    """Time each arm once a round, in turn, for `rounds` rounds (module docstring)."""
    from mtplxd.engine.bench.real_size import kernel_installed
    from mtplxd.engine.decoding import fused_ar

    features = {arm: parse_arm(arm) for arm in arms}
    models = {key: build_for_steps(size, dtype, stacked="stacked" in key, qk_norm_rope="norm-rope" in key)
              for key in dict.fromkeys(f & MODEL_FEATURES for f in features.values())}
    model_of = {arm: models[features[arm] & MODEL_FEATURES] for arm in arms}
    prompt = prompt_for(next(iter(models.values()))[1], context)
    timed: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    for _ in range(rounds):
        for arm in arms:
            model, trunk, _ = model_of[arm]
            wanted = features[arm]
            # The kernel in for the turn, out after, the compiled graphs dropped both ways.
            routing = (kernel_installed(model, trunk, force=True, row_invariant=_routing(wanted))
                       if "kernel" in wanted else contextlib.nullcontext(0))
            fused_ar.force(True if "compiled-ar" in wanted else False if "op-by-op-ar" in wanted else None)
            try:
                with routing as switched:
                    timed[arm].append({**time_loop(trunk, model, prompt, depth, steps, warmup),
                                       "kernel_layers": switched})
            finally:
                fused_ar.force(None)
    return {"size": size, "dtype": dtype, "depth": depth, "steps": steps, "rounds": rounds,
            "context": context,
            "arms": {arm: _arm_report(features[arm], timed[arm], model_of[arm][2]) for arm in arms},
            "ratio_to_first": _ratios(arms, timed)}


def _routing(features: frozenset[str]) -> bool | None:
    """install's `row_invariant` for an arm: True, False (mixed) or None (as served)."""
    return True if "row-invariant" in features else False if "mixed" in features else None


def _arm_report(features: frozenset[str], rounds: list[dict[str, Any]], built: dict[str, int]) -> dict[str, Any]:
    wall = [r["wall_ms_per_step"] for r in rounds]
    cpu = [r["cpu_ms_per_step"] for r in rounds]
    return {"features": sorted(features), **built, "loop": rounds[0]["loop"],
            "kernel_layers": rounds[0]["kernel_layers"], "wall_ms_per_step": wall, "cpu_ms_per_step": cpu,
            "median_wall_ms": statistics.median(wall), "median_cpu_ms": statistics.median(cpu),
            "tokens_per_step": statistics.median(r["tokens_per_step"] for r in rounds)}


def _ratios(arms: list[str], timed: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Each arm's wall ms over the first arm's, round by round (steps seconds apart)."""
    first = [r["wall_ms_per_step"] for r in timed[arms[0]]]
    out = {}
    for arm in arms[1:]:
        by_round = [r["wall_ms_per_step"] / base for r, base in zip(timed[arm], first)]
        out[arm] = {"by_round": by_round, "median": statistics.median(by_round)}
    return out


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = bench_parser(PROG, __doc__)
    parser.add_argument("--size", default="qwen3-4b")
    parser.add_argument("--dtype", default="4bit")
    parser.add_argument("--arms", required=True, help="comma-separated arms, e.g. kernel,kernel+stacked")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--depth", type=int, default=0, help="0: the AR loop; K: the MTP loop at depth K")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args(argv)
    arms = [arm.strip() for arm in args.arms.split(",")]
    try:
        for arm in arms:
            parse_arm(arm)
    except ValueError as exc:
        parser.error(str(exc))
    if len(set(arms)) != len(arms) or min(args.rounds, args.steps) < 1:
        parser.error("--arms must not repeat an arm; --rounds and --steps must be at least 1")
    report = {**machine(), "command": command_line(PROG, argv),
              **run_arms(args.size, args.dtype, arms, depth=args.depth, steps=args.steps,
                         rounds=args.rounds, context=args.context)}
    for arm, row in report["arms"].items():
        ratio = report["ratio_to_first"].get(arm)
        print(f"{arm:32s} {row['median_wall_ms']:7.2f} ms a step (CPU {row['median_cpu_ms']:.2f}; "
              f"{row['loop']})" + (f", {ratio['median']:.3f}x the first arm" if ratio else ""), flush=True)
    if args.json_out:
        write_report(args.json_out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
