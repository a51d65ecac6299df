"""Float32 matrix products in float32, chosen before MLX multiplies anything.

MLX runs float32 matmuls in TF32 where the hardware has it unless `MLX_ENABLE_TF32` is 0 (its
default is 1): on NVIDIA GPUs from Ampere on (cuBLAS's fast-TF32 compute type) and on Apple's
M5-class neural accelerators. TF32 rounds the inputs to 10 mantissa bits, about 1e-3 relative
error per product, against 6e-8 in float32.

The engine's float32 products are the ones where it wants float32: the chunked Gated DeltaNet
verify (`engine/model/gdn_chunked.py`) keeps the recurrence in float32 so that a verify row
matches the AR step's token-by-token recurrence to float rounding, and exact MTP rests on that
match (greedy MTP output equal to AR's, except at measured near-ties on a GPU). The models'
own weights are bf16 or quantized, whose matmuls TF32 does not touch, so turning TF32 off
costs nothing measurable there. A value the user set is kept. This module imports neither MLX
nor trio.
"""

from __future__ import annotations

import os

ENV = "MLX_ENABLE_TF32"


def activate(environ: dict[str, str] | None = None) -> bool:
    """Ask MLX for full float32 matmuls unless the user chose; True when this set it."""
    env = os.environ if environ is None else environ
    if env.get(ENV, "") != "":
        return False
    env[ENV] = "0"
    return True


def path_name(on_gpu: bool, environ: dict[str, str] | None = None) -> str:
    """What /health and status say float32 matmuls run in: "float32", or "tf32 where the
    GPU has it" when the user turned TF32 back on (a CPU backend always multiplies in float32)."""
    env = os.environ if environ is None else environ
    if not on_gpu or env.get(ENV, "1") == "0":
        return "float32"
    return "tf32 where the GPU has it"
