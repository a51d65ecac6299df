"""What every custom CUDA kernel of the engine shares: it is used only after a probe on
this machine compiled it and matched MLX's own ops, and any failure leaves MLX's ops in place;
and it is built from its source without comments or indentation (`cuda_kernel`).
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable

log = logging.getLogger(__name__)


def probe(name: str, error: Callable[[], float], limit: float, fallback: str) -> bool:
    """True when `error()` runs (compiling and launching the kernel) and stays below `limit`;
    otherwise log why and return False, so the caller keeps `fallback`."""
    try:
        measured = error()
    except Exception as exc:  # noqa: BLE001 - any JIT or launch failure means "not here"
        log.warning("%s kernel unavailable, using %s: %s", name, fallback, exc)
        return False
    if not measured < limit:
        log.warning("%s kernel disagrees with %s (error %s); not using it", name, fallback, measured)
        return False
    return True


# A C++ string or character literal, or a comment: what `compact` must tell apart.
_LITERAL_OR_COMMENT = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|//[^\n]*|/\*.*?\*/', re.S)


def compact(source: str) -> str:
    """CUDA C++ `source` with its comments, indentation, runs of blanks and empty lines taken
    out: the same tokens, each preprocessor directive still on its own line, string literals
    (the inline PTX) as written.

    Why: MLX's CUDA backend hashes a custom kernel's whole source each time it encodes a launch
    (`CustomKernel::eval_gpu`, mlx 0.32), before it finds the compiled module. On an H100's host
    a kernel whose source carried 20 kB more took 3.7-4.2 us more a launch, with CUDA graphs and
    without (bench.launch_cost; docs/benchmarks.md, "A kernel's host cost"); small_m_qmm's
    vector layout is about 19 kB as written, half of it comments and indentation. A step of a
    4-bit Qwen3-4B is host-bound: about 110 of its kernels are that layout's."""
    def drop_comment(match: re.Match[str]) -> str:
        text = match.group()
        if text.startswith("//"):
            return ""
        return " " if text.startswith("/*") else text

    lines = []
    for line in _LITERAL_OR_COMMENT.sub(drop_comment, source).splitlines():
        line = line.strip()
        if line and '"' not in line and "'" not in line:
            line = re.sub(r"[ \t]+", " ", line)
        if line:
            lines.append(line)
    return "\n".join(lines) + "\n"


def cuda_kernel(*, source: str, header: str = "", **kwargs: Any) -> Any:
    """`mx.fast.cuda_kernel` built from `compact(source)` and `compact(header)`; the other
    arguments (name, input_names, output_names, ...) as MLX takes them."""
    import mlx.core as mx

    return mx.fast.cuda_kernel(source=compact(source), header=compact(header) if header else "", **kwargs)
