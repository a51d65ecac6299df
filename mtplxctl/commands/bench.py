"""bench: AR vs MTP decode speed and acceptance on this machine, printed and saved as JSON;
with --streams, concurrent streams (serial MTP, AR batch lane, MTP cohorts side by side).

Runs the engine benchmark in this process (not through the daemon, so the numbers are the
engine's own); results go to ~/.mtplx/metrics/bench-<time>.json unless --json-out says where.
"""

from __future__ import annotations

import argparse
import time

from mtplxd.config import ConfigError, load_config
from mtplxd.paths import Paths
from mtplxctl.output import fail, whole_number


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="measure AR vs MTP decode speed on this machine")
    bench.add_argument("--model", help="model folder or pulled repo (default: the configured one)")
    bench.add_argument("--depth", type=whole_number(0, 16), help="MTP depth (default: the model's)")
    bench.add_argument("--max-tokens", type=whole_number(1, 1_000_000), default=128, help="tokens per run (default 128)")
    bench.add_argument("--repeats", type=whole_number(1, 1000), default=3, help="passes over the prompt set")
    bench.add_argument("--temperatures", default="0,0.6", help="comma-separated (default 0,0.6)")
    bench.add_argument("--json-out", help="where to save the report")
    bench.add_argument("--decode-loop", choices=("auto", "fused", "stepwise"),
                       help="MTP decode loop (default: the configured decode_loop)")
    bench.add_argument("--quantize", choices=("auto", "none", "8bit", "4bit"),
                       help="quantize the weights as they load (default: the configured quantize)")
    bench.add_argument("--dequantize", choices=("auto", "on", "off"),
                       help="Linux CPU: a quantized model's weights as dense float32 (default: the "
                            "configured dequantize)")
    bench.add_argument("--streams", help="concurrent streams instead, e.g. 1,2,3,4,8: serial MTP, "
                       "interleaved MTP, the AR batch lane and MTP cohorts side by side")
    bench.add_argument("--numerics", choices=("exact", "throughput"), default="throughput",
                       help="with --streams: the cohorts' numerics (default throughput)")
    bench.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    # Imported here: the engine brings MLX, a second of startup no other command should pay.
    from mtplxd.engine.bench import decode as bench
    from mtplxd.models.resolve import ModelLoadFailed, resolve_model

    paths = Paths.from_env()
    try:
        config = load_config(paths.config_file)
        folder, _ = resolve_model(args.model or config.model, paths.models_dir)
    except (ConfigError, ModelLoadFailed) as exc:
        return fail(str(exc))
    out = args.json_out or str(paths.metrics_dir / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json")
    # The weights as the daemon would serve them, unless asked otherwise.
    weights = ["--quantize", args.quantize or config.quantize,
               "--dequantize", args.dequantize or config.dequantize]
    if args.streams:
        return _bench_streams(args, str(folder), out, weights)
    argv = ["--model", str(folder), "--max-tokens", str(args.max_tokens), "--repeats",
            str(args.repeats), "--temperatures", args.temperatures, "--json-out", out,
            "--decode-loop", args.decode_loop or config.decode_loop, *weights]
    if args.depth is not None:
        argv += ["--depth", str(args.depth)]
    return bench.main(argv)


def _bench_streams(args: argparse.Namespace, folder: str, out: str, weights: list[str]) -> int:
    from mtplxd.engine.bench import concurrency

    try:
        streams = [int(n) for n in args.streams.split(",") if n.strip()]
    except ValueError:
        streams = []
    if not streams or min(streams) < 1:
        return fail(f"--streams takes stream counts such as 1,2,3,4,8, got {args.streams}")
    argv = ["--model", folder, "--streams", ",".join(map(str, streams)), "--max-tokens",
            str(args.max_tokens), "--repeats", str(args.repeats), "--numerics", args.numerics,
            *weights, "--json-out", out]
    if args.depth is not None:
        argv += ["--depth", str(args.depth)]
    from mtplxd.engine.bench.harness import exit_without_teardown

    exit_without_teardown(concurrency.main(argv))  # it ran MLX on an owner thread
    return 0  # not reached
