"""Is decoding bound by the host or by the device? Host time per step against wall time per
step, and the primitives in each step's graph, for the AR loop and the fused MTP cycle.

    python -m mtplxd.engine.bench.host --model PATH [--depth D] [--tokens 128]
        [--quantize auto|none|8bit|4bit] [--json-out FILE]

Both loops build step t+1 and hand it to the device before they read step t. `host_ms` is
the time to build and submit one step (AR: Python builds the graph op by op; MTP: a compiled
cycle is replayed), `wait_ms` the time then spent waiting for the device to finish the step
before it, `wall_ms` the wall time per step; for AR, `build_ms` is the part of `host_ms`
spent building the graph in Python, before MLX encodes it. A caveat on a GPU: MLX's
`async_eval` itself waits for the device once more than 10 of its command buffers are in
flight (mlx/transforms.cpp, MAX_ACTIVE_TASKS; MLX commits a CUDA graph every
MLX_MAX_OPS_PER_BUFFER kernels), so for a model whose step commits more than 10 (a 32B
model at the H200's default of 100 kernels a graph) `host_ms` includes device time and only
`build_ms` is the host's alone. When `wait_ms` is near 0 the device idles for
the host, and a step costs what its primitives cost the host to encode: fewer primitives
per committed token is then what makes decoding faster, not fewer FLOPs. The counts are
primitives of one step's graph as handed to the device (views included; compiled graphs
count each fused kernel once). Runs on the first bench prompt at T=0 and at T=0.6, top-p
0.95, seed 0.
"""

from __future__ import annotations

import collections
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

from mtplxd.engine.bench.harness import (
    PROMPTS, cycle_bench_parser, device_name, load_dense_mtp_model, median, prompt_ids_for, write_report,
)
from mtplxd.engine.decoding.autoregressive import ar_step
from mtplxd.engine.decoding.fused import FusedSpeculativeDecoder
from mtplxd.engine.decoding.sampling import TokenHistory, pick_first
from mtplxd.engine.interface import SamplingParams

SETTINGS = {"T=0": SamplingParams(temperature=0.0),
            "T=0.6": SamplingParams(temperature=0.6, top_p=0.95)}
SKIPPED = 8  # first steps left out of the medians (allocation, compile)


def primitives(arrays: list[mx.array]) -> dict[str, int]:
    """{primitive: count} over the unevaluated graph behind `arrays`."""
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as dot:
        mx.export_to_dot(dot.name, *arrays)
        labels = re.findall(r'label ="(\w+)", shape=rectangle', Path(dot.name).read_text())
    return dict(collections.Counter(labels).most_common())


def _summary(host: list[float], wait: list[float], counts: dict[str, int],
             build: list[float] | None = None) -> dict[str, Any]:
    skipped = min(SKIPPED, len(host) - 1)  # a short warm-up run keeps its last step
    host, wait = host[skipped:], wait[skipped:]
    out = {"host_ms": 1e3 * median(host), "wait_ms": 1e3 * median(wait),
           "wall_ms": 1e3 * median([h + w for h, w in zip(host, wait)]),
           "primitives": sum(counts.values()), "by_primitive": counts}
    if build is not None:
        out["build_ms"] = 1e3 * median(build[skipped:])
    return out


def measure_ar(trunk, vocab_size: int, ids: list[int], params: SamplingParams, steps: int) -> dict[str, Any]:
    """The AR loop's step on `trunk` after prefilling `ids`: host, wait and wall ms, and its
    primitives (bench.real_size takes it for its random real-size models too)."""
    cache = trunk.make_cache()
    _, logits = trunk.prefill(ids, cache)
    history = TokenHistory(vocab_size, ids)
    first = pick_first(logits, params, history, 0, len(ids))
    step = ar_step(trunk, cache, params, history, seed=0)
    current, following = step(mx.array([first], mx.uint32), mx.array([len(ids) + 1], mx.uint32))
    counts = primitives([current])
    mx.eval(current, following)
    pending, following = step(current, following)
    mx.async_eval(pending)
    host, wait, build = [], [], []
    for _ in range(steps):
        current, started = pending, time.perf_counter()
        pending, following = step(current, following)
        built = time.perf_counter()
        mx.async_eval(pending)
        submitted = time.perf_counter()
        current.item()
        build.append(built - started)
        host.append(submitted - started)
        wait.append(time.perf_counter() - submitted)
    return _summary(host, wait, counts, build)


class _TimedDecoder(FusedSpeculativeDecoder):
    """The fused decoder, timing each cycle's launch and counting the first cycle's graph."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.launch_s: list[float] = []
        self.counts: dict[str, int] | None = None

    def _launch(self, state, seed):
        if self.counts is None:
            mx.eval(state.flat())  # so the count is this cycle's graph alone
            self.counts = primitives(list(self._cycle(seed, *state.flat())))
        started = time.perf_counter()
        launched = super()._launch(state, seed)
        self.launch_s.append(time.perf_counter() - started)
        return launched


def measure_mtp(model, ids: list[int], params: SamplingParams, depth: int,
                tokens: int) -> dict[str, Any]:
    """The fused cycle: host (launch), wait and wall ms per cycle, tokens per cycle, primitives."""
    trunk = model.trunk
    cache = trunk.make_cache()
    hiddens, logits = trunk.prefill(ids, cache)
    history = TokenHistory(model.info.vocab_size, ids)
    first = pick_first(logits, params, history, 0, len(ids))
    decoder = _TimedDecoder(trunk, model.head, cache, params, history, 0, depth)
    walls, committed = [], 0
    cycles = decoder.cycles(hiddens, ids, first)
    started = time.perf_counter()
    for out in cycles:
        now = time.perf_counter()
        walls.append(now - started)
        started = now
        committed += len(out)
        if committed >= tokens:
            break
    cycles.close()
    # A yield's wall time is the launch of the cycle after it plus the wait for it.
    host = decoder.launch_s[1:len(walls) + 1]
    wait = [max(wall - launch, 0.0) for wall, launch in zip(walls, host)]
    report = _summary(host, wait, decoder.counts or {})
    report["tokens_per_cycle"] = committed / len(walls)
    return report


def run(model, depth: int, tokens: int) -> dict[str, Any]:
    """{setting: {"ar": ..., "mtp": ...}} on the first bench prompt, after a warm-up of each."""
    ids = prompt_ids_for(model.tokenizer, PROMPTS[0])
    report: dict[str, Any] = {}
    for name, params in SETTINGS.items():
        measure_ar(model.trunk, model.info.vocab_size, ids, params, SKIPPED + 4)  # warm-up: first-call costs
        measure_mtp(model, ids, params, depth, 16)
        report[name] = {"ar": measure_ar(model.trunk, model.info.vocab_size, ids, params, tokens),
                        "mtp": measure_mtp(model, ids, params, depth, tokens)}
    return report


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = cycle_bench_parser("python -m mtplxd.engine.bench.host", __doc__)
    parser.add_argument("--depth", type=int, default=None, help="MTP depth (default: the model's)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens decoded per measurement")
    args = parser.parse_args(argv)

    model = load_dense_mtp_model(args.model, args.quantize)
    if model is None:
        return 2
    depth = model.info.depth if args.depth is None else args.depth
    report = run(model, depth, args.tokens)
    for name, entry in report.items():
        for loop, row in entry.items():
            extra = f", {row['tokens_per_cycle']:.2f} tokens/cycle" if "tokens_per_cycle" in row else ""
            print(f"{name:6s} {loop:4s} host {row['host_ms']:7.3f} ms  wait {row['wait_ms']:7.3f} ms  "
                  f"wall {row['wall_ms']:7.3f} ms  {row['primitives']:5d} primitives{extra}")
    if args.json_out:
        report = {"model": model.info.id, "quantization": model.info.quantization, "depth": depth,
                  "device": device_name(), "mlx_version": mx.__version__,
                  "settings": report}
        write_report(args.json_out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
