"""What every benchmark shares: warm-up and median timing, interleaved A/B runs, paired
ratios, the prompt set, the common command-line options and the JSON report.

Figures are medians because the machines these run on are shared and noisy: one slow run
moves a mean, not a median. Two arms of a comparison run interleaved (back to back on the
same input) so slow drifts of the machine (thermals, other load) hit both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence, TypeVar

from mtplxd.engine.interface import DEQUANTIZE_CHOICES, QUANTIZE_CHOICES

Case = TypeVar("Case")
Result = TypeVar("Result")

# The decode benches' prompts: short chat requests of the kind a coding agent sends.
PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain what a KV cache is in two sentences.",
    "def parse_args(argv):\n    \"\"\"Parse command line arguments.\"\"\"\n",
    "Refactor this loop into a list comprehension: for x in xs: if x > 0: out.append(x * 2)",
)


# --- timing ------------------------------------------------------------------------------


def median(values: Iterable[float]) -> float:
    """The median of `values`, 0.0 when there are none (a mode that never ran)."""
    values = list(values)
    return statistics.median(values) if values else 0.0


def elapsed_ms(fn: Callable[[], Any]) -> float:
    """Wall milliseconds of one call of fn()."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def median_ms(fn: Callable[[], Any], repeats: int, warmup: int = 3) -> float:
    """Median wall milliseconds of fn() over `repeats` calls, after `warmup` calls (first-call
    costs such as compiling a graph stay out of the figure)."""
    for _ in range(warmup):
        fn()
    return statistics.median(elapsed_ms(fn) for _ in range(repeats))


def interleaved(cases: Sequence[Case], repeats: int,
                arms: Sequence[Callable[[Case, int, int], Result]]) -> list[list[Result]]:
    """Run every arm on every case, back to back, `repeats` times over; per arm, its results
    in run order. Each arm is called as arm(case, repeat, index)."""
    results: list[list[Result]] = [[] for _ in arms]
    for repeat in range(repeats):
        for index, case in enumerate(cases):
            for arm, out in zip(arms, results):
                out.append(arm(case, repeat, index))
    return results


def paired_speedups(ar_rates: list[float], mtp_rates: list[float]) -> dict[str, float]:
    """MTP/AR over all tokens (ratio of the harmonic means of equal-length runs' rates) and
    the median and lowest ratio of the back-to-back pairs (run i of each list). Pairs with a
    zero rate (a run that decoded nothing) are left out of all three."""
    valid = [(ar, mtp) for ar, mtp in zip(ar_rates, mtp_rates) if ar > 0 and mtp > 0]
    if not valid:
        return {"speedup_all_tokens": 0.0, "speedup_pairs_median": 0.0, "speedup_pairs_min": 0.0}
    ar_kept, mtp_kept = zip(*valid)
    pairs = [mtp / ar for ar, mtp in valid]
    return {"speedup_all_tokens": statistics.harmonic_mean(mtp_kept) / statistics.harmonic_mean(ar_kept),
            "speedup_pairs_median": statistics.median(pairs), "speedup_pairs_min": min(pairs)}


# --- prompts and models --------------------------------------------------------------------


def prompt_ids_for(tokenizer: Any, text: str) -> list[int]:
    """The token ids the bench sends for a prompt text (chat-templated when the model has one)."""
    if getattr(tokenizer, "has_chat_template", False):
        return tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True)
    return tokenizer.encode(text)


def load_dense_mtp_model(path: str, quantize: str) -> Any:
    """The model at `path` for the fused-cycle benches; None (said on stderr) when it is not a
    dense model with an MTP head."""
    from mtplxd.engine.decoding import fused
    from mtplxd.engine.loaded_model import load_model

    model = load_model(path, quantize=quantize)
    if model.head is None or not fused.fused_supported(model.trunk, model.trunk.make_cache()):
        print(f"{model.info.id}: needs a dense model with an MTP head", file=sys.stderr)
        return None
    return model


# --- command line and report ---------------------------------------------------------------


def bench_parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
    """A parser whose help shows the module docstring as written."""
    return argparse.ArgumentParser(prog=prog, description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def add_quantize_option(parser: argparse.ArgumentParser) -> None:
    """--quantize, as every engine bench takes it."""
    parser.add_argument("--quantize", choices=QUANTIZE_CHOICES, default="auto",
                        help="quantize the weights as they load (default: what the checkpoint asks for)")


def add_dequantize_option(parser: argparse.ArgumentParser) -> None:
    """--dequantize: a quantized checkpoint's weights as dense float32 on the Linux CPU or not
    (load_model's `dequantize_weights`, the daemon's `dequantize` setting)."""
    parser.add_argument("--dequantize", choices=DEQUANTIZE_CHOICES, default="auto",
                        help="Linux CPU: a quantized checkpoint's weights as dense float32 (default: "
                             "auto, where they take at most half the memory)")


def add_small_m_kernel_option(parser: argparse.ArgumentParser) -> None:
    """--small-m-kernel: load the model with its quantized layers on small_m_qmm's kernel."""
    parser.add_argument("--small-m-kernel", action="store_true",
                        help="route quantized layers through the small-M kernel (CUDA only)")


def add_decode_options(parser: argparse.ArgumentParser, max_tokens: int = 128) -> None:
    """The options of the benches that decode the prompt set at a depth and temperatures:
    --model, --depth, --max-tokens, --repeats, --temperatures, --decode-loop, --quantize."""
    from mtplxd.engine.interface import DECODE_LOOP_CHOICES

    parser.add_argument("--model", required=True, help="HF-format model folder")
    parser.add_argument("--depth", type=int, default=None, help="MTP depth (default: the model's)")
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--repeats", type=int, default=3, help="passes over the prompt set")
    parser.add_argument("--temperatures", default="0,0.6", help="comma-separated, e.g. 0,0.6")
    parser.add_argument("--decode-loop", choices=DECODE_LOOP_CHOICES, default="auto",
                        help="MTP decode loop (default: the backend's); AR always runs the plain loop")
    add_quantize_option(parser)


def cycle_bench_parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
    """A parser with the options every fused-cycle bench takes: --model, --quantize, --json-out."""
    parser = bench_parser(prog, doc)
    parser.add_argument("--model", required=True, help="HF-format model folder with an MTP head")
    add_quantize_option(parser)
    parser.add_argument("--json-out", type=Path, default=None)
    return parser


def command_line(prog: str, argv: list[str] | None) -> str:
    """The command as run, for the report (so a figure can be reproduced)."""
    return " ".join([prog] + (argv if argv is not None else sys.argv[1:]))


def device_name() -> str:
    """MLX's default device, as the reports name it (e.g. "Device(cpu, 0)")."""
    import mlx.core as mx

    return str(mx.default_device())


def machine() -> dict[str, Any]:
    """The device, BLAS, MLX version, float32 matmul precision, MLX settings from the
    environment and platform a report's figures come from."""
    import mlx.core as mx

    from mtplxd import blas, matmul_precision

    return {"device": device_name(), "blas": blas.snapshot(), "mlx_version": mx.__version__,
            "float32_matmul": matmul_precision.path_name(on_gpu=mx.default_device() == mx.gpu),
            "mlx_environment": mlx_environment(), "platform": platform.platform()}


def mlx_environment() -> dict[str, str]:
    """The MLX_* variables set in this process (MLX reads e.g. MLX_MAX_OPS_PER_BUFFER once, at
    start; a run under other CUDA graph limits is another run)."""
    return {name: value for name, value in sorted(os.environ.items()) if name.startswith("MLX_")}


def write_report(path: str | Path, report: dict[str, Any], *, indent: int = 2, announce: bool = False) -> None:
    """Write `report` as JSON to `path` (parent folders made); with `announce`, say so."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=indent) + "\n")
    if announce:
        print(f"saved {path}")


def print_and_save(report: dict[str, Any], json_out: str | None) -> int:
    """Print `report` as JSON, save it to `json_out` when given; the exit status 0."""
    print(json.dumps(report, indent=2))
    if json_out:
        write_report(json_out, report)
    return 0


def exit_without_teardown(code: int) -> None:
    """Leave the process now, after flushing output, without interpreter teardown: a bench
    that ran MLX on a model-owner thread can abort in MLX's native thread teardown at exit
    ("terminate called without an active exception"), as the daemon did (mtplxd.__main__)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
