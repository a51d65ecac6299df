"""Decode speed of a model served over 1, 2 or 3 ranks (pipeline or tensor parallel), AR and
MTP, with the communication time of each cycle separated out.

    python -m mtplxd.engine.bench.distributed --ranks 1,2,3 --layers 8 --hidden 1024 \\
        --json-out bench-distributed.json
    python -m mtplxd.engine.bench.distributed --parallel tensor --ranks 1,2 ...

Writes a random-weight dense qwen3 checkpoint with an MTP head (fixtures/tiny.py, sized by
the options, so the split matters) unless --model names one. Ranks 1 is the single process
(`load_model`); 2 and 3 start a real group on 127.0.0.1 (ring backend) through
`engine/distributed/run.py`, the same launcher the daemon uses. Every configuration runs the
same prompts, AR and MTP back to back per prompt. Reported per configuration: median decode
tok/s of AR and of MTP, the median of the paired MTP/AR ratios, acceptance, and for groups the
ring exchange time split into the workers' compute and the rest (communication: send,
receive, wake-ups), per exchange and per hop. A cycle is one exchange (the verify of K+1
tokens goes around the ring once).

Tensor parallel has no such split: every rank computes its share of each layer and the
shares meet in two all_sums per layer, so communication interleaves with compute. Its report
gives the exchange (a whole forward, rank 0's share and every all_sum included) per cycle,
and the all_sums one exchange makes; the paired single-process run says what the split costs.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from mlx_lm.utils import load_tokenizer

from mtplxd.engine.bench.harness import (
    bench_parser, command_line, machine, median, paired_speedups, prompt_ids_for, write_report,
)
from mtplxd.engine.fixtures.tiny import write_tiny_checkpoint
from mtplxd.engine.interface import GenerationRequest, SamplingParams
from mtplxd.engine.loaded_model import load_model
from mtplxd.engine.model.loader import safetensors_header, weight_files

PROMPTS = ("def fibonacci(n):", "Explain a KV cache.", "for x in xs: if x > 0:", "import json\n")


def make_model(dest: Path, layers: int, hidden: int, dtype: str = "float32") -> Path:
    """A random-weight dense qwen3 with an MTP head, `layers` x `hidden` (heads of 64), its
    weights saved in `dtype`. Built where MLX computes (on a GPU machine, on the device)."""
    heads = max(hidden // 64, 1)
    return write_tiny_checkpoint(dest, "qwen3", num_hidden_layers=layers, hidden_size=hidden,
                                 intermediate_size=hidden * 3, num_attention_heads=heads,
                                 num_key_value_heads=max(heads // 4, 1), head_dim=64,
                                 torch_dtype=dtype)


def checkpoint_summary(model_path: Path) -> dict[str, Any]:
    """Parameters, bytes on disk and dtypes of a checkpoint (from its safetensors headers)."""
    files = weight_files(model_path)
    tensors = [t for file in files for t in safetensors_header(file).values()]
    return {"parameters": sum(math.prod(t["shape"]) for t in tensors),
            "bytes": sum(f.stat().st_size for f in files),
            "dtypes": sorted({t["dtype"] for t in tensors})}


def single(model_path: Path, prompts: list[list[int]], depth: int, max_tokens: int,
           repeats: int) -> list[dict[str, Any]]:
    """The single-process runs, in the group runner's order and shape."""
    model = load_model(model_path)
    out = []
    for _ in range(repeats):
        for index, prompt in enumerate(prompts):
            for d in (0, depth):
                stats = model.complete(GenerationRequest(
                    prompt, SamplingParams(max_tokens=max_tokens), depth=d)).stats
                out.append({"prompt": index, "depth": d, "cycles": stats.cycles,
                            "decode_tokens_per_second": stats.decode_tokens_per_second,
                            "mean_accepted_length": stats.mean_accepted_length})
    return out


def group(model_path: Path, ranks: int, prompts: list[list[int]], depth: int, max_tokens: int,
          repeats: int, workdir: Path, parallel: str = "pipeline") -> dict[str, Any]:
    """A real group of `ranks` local ranks (`parallel`: pipeline or tensor) running the same
    requests; run.py's JSON."""
    hosts = workdir / f"hosts{ranks}.json"
    hosts.write_text(json.dumps({"backend": "ring", "parallel": parallel,
                                 "hosts": [{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * ranks}))
    command = [sys.executable, "-m", "mtplxd.engine.distributed.run", "--hosts", str(hosts),
               "--model", str(model_path), "--prompts", json.dumps(prompts),
               "--depths", f"0,{depth}", "--max-tokens", str(max_tokens),
               "--repeats", str(repeats), "--timeout", "300", "--log-dir", str(workdir / "logs")]
    done = subprocess.run(command, capture_output=True, text=True)
    if not done.stdout.strip():
        raise RuntimeError(f"the {ranks}-rank group printed nothing: {done.stderr[-2000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if "results" not in out:
        raise RuntimeError(f"the {ranks}-rank group failed: {out}")
    return out


def summarise(results: list[dict[str, Any]], depth: int) -> dict[str, Any]:
    """Medians of AR and MTP decode speed, the paired ratios, acceptance."""
    ar = [r["decode_tokens_per_second"] for r in results if r["depth"] == 0]
    mtp = [r["decode_tokens_per_second"] for r in results if r["depth"] == depth]
    accepted = [r["mean_accepted_length"] for r in results if r["depth"] == depth]
    return {"ar_decode_tok_s": round(median(ar), 3), "mtp_decode_tok_s": round(median(mtp), 3),
            **{k: round(v, 3) for k, v in paired_speedups(ar, mtp).items()},
            "mtp_mean_accepted_length": round(median(accepted), 3), "runs_per_mode": len(ar)}


def _exchange_ms_per_cycle(out: dict[str, Any]) -> dict[str, float]:
    """Ring exchange time per decode cycle, by depth."""
    by_depth = {}
    for depth in sorted({r["depth"] for r in out["results"]}):
        rows = [r for r in out["results"] if r["depth"] == depth]
        cycles = sum(r["cycles"] for r in rows)
        by_depth[f"depth_{depth}_exchange_ms_per_cycle"] = round(
            1e3 * sum(r["exchange_seconds"] for r in rows) / max(cycles, 1), 3)
    return by_depth


def tensor_timing(out: dict[str, Any]) -> dict[str, Any]:
    """A tensor group's exchanges: whole split forwards (compute and all_sums interleaved)."""
    first, last = out["group"]["ranks"][0]["layers"]  # every rank holds a share of them all
    layers = last - first
    return {"exchanges": sum(r["exchanges"] for r in out["results"]),
            "exchange_seconds": round(sum(r["exchange_seconds"] for r in out["results"]), 4),
            "all_sums_per_exchange": 2 * layers,  # after attention's o_proj and the MLP's down
            "link_at_start": out["group"]["link"], **_exchange_ms_per_cycle(out)}


def communication(out: dict[str, Any], ranks: int) -> dict[str, Any]:
    """Exchange time less the workers' compute: what the ring itself cost, per exchange and
    per hop (an exchange has `ranks` hops: 0 -> 1 -> ... -> 0)."""
    exchanges = sum(r["exchanges"] for r in out["results"])
    exchange_s = sum(r["exchange_seconds"] for r in out["results"])
    compute_s = sum(w["compute_seconds"] for w in out["workers"])
    comm_s = max(exchange_s - compute_s, 0.0)
    per = comm_s / exchanges if exchanges else 0.0
    return {"exchanges": exchanges, "exchange_seconds": round(exchange_s, 4),
            "worker_compute_seconds": round(compute_s, 4),
            "communication_ms_per_exchange": round(per * 1e3, 3),
            "communication_ms_per_hop": round(per * 1e3 / ranks, 3),
            "link_at_start": out["group"]["link"], "split": out["group"]["split"],
            **_exchange_ms_per_cycle(out)}


def main(argv: list[str] | None = None) -> int:
    """Run every configuration, print and save the JSON report."""
    parser = bench_parser("python -m mtplxd.engine.bench.distributed", __doc__)
    parser.add_argument("--model", type=Path, default=None, help="a checkpoint (default: write one)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="the written model's weights (without --model)")
    parser.add_argument("--ranks", default="1,2,3", help="configurations to run, e.g. 1,2,3")
    parser.add_argument("--parallel", default="pipeline", choices=("pipeline", "tensor"),
                        help="how a group of 2 or more ranks splits the model")
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="mtplx-bench-distributed-"))
    began = time.perf_counter()
    model_path = args.model or make_model(workdir / "model", args.layers, args.hidden, args.dtype)
    build_seconds = round(time.perf_counter() - began, 1)
    tokenizer = load_tokenizer(model_path)  # not the whole model: it may be tens of GB
    prompts = [prompt_ids_for(tokenizer, text) for text in PROMPTS]
    report: dict[str, Any] = {"command": command_line("python -m mtplxd.engine.bench.distributed", argv),
                              "machine": machine(), "model": str(model_path),
                              "checkpoint": checkpoint_summary(model_path),
                              "build_seconds": None if args.model else build_seconds,
                              "layers": args.layers, "hidden": args.hidden, "depth": args.depth,
                              "parallel": args.parallel,
                              "max_tokens": args.max_tokens, "configurations": {}}
    for ranks in [int(r) for r in args.ranks.split(",")]:
        if ranks == 1:
            results = single(model_path, prompts, args.depth, args.max_tokens, args.repeats)
            entry = summarise(results, args.depth)
        else:
            out = group(model_path, ranks, prompts, args.depth, args.max_tokens, args.repeats,
                        workdir, args.parallel)
            timing = (tensor_timing(out) if args.parallel == "tensor"
                      else communication(out, ranks))
            entry = {**summarise(out["results"], args.depth), **timing}
        report["configurations"][f"{ranks}_ranks"] = entry
        report["seconds"] = round(time.perf_counter() - began, 1)
        print(f"{ranks} rank(s): {json.dumps(entry)}", file=sys.stderr)
        if args.json_out:  # after every configuration: a run cut short keeps what it measured
            write_report(args.json_out, report)
    if args.model is None:  # a written model may be tens of GB: the report keeps its summary
        shutil.rmtree(model_path, ignore_errors=True)
    print(json.dumps(report, indent=2))
    if args.json_out:
        print(f"saved {args.json_out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
