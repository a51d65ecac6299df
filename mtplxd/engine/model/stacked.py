"""An MLP's gate and up projections served as one product (opt-in: MTPLX_STACKED_MLP=1).

Why: on an H100 the hybrid 27B's 4-bit decode step was its quantized products, and a product
reads its weights faster the wider its matrix is (the tensor-core layout at 1 row: gate_proj,
17,408 rows, 36 us at 32% of the roofline; the 248k-row lm_head at 59%; docs/benchmarks.md,
"Whole steps on an H100"). gate_proj and up_proj read the same input, so one product of the
two stacked along the output dimension replaces two. Off by default until the GPU measures
it in whole steps (`bench.fused_products` for the products alone, `bench.real_size
--stacked-mlp` for the steps).

Exactness: each output column of a quantized product is its own weight row's dot product with
the input, so the stacked product's columns are the two products' outputs; on the CPU backend
the quantized products are bit for bit equal (a test), and greedy MTP stays equal to AR
whatever is stacked (both run the same model). A float32 matmul through a BLAS need not be
(its blocking may change with the width): stacking is for quantized checkpoints served as
such.
"""

from __future__ import annotations

import os

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3, qwen3_next
from mlx_lm.models.activations import swiglu

ENV = "MTPLX_STACKED_MLP"
# mlx-lm's MLPs that compute down(swiglu(gate(x), up(x))); qwen3_5's is qwen3_next's.
SWIGLU_MLPS = (qwen3.MLP, qwen3_next.Qwen3NextMLP)


class StackedMLP(nn.Module):
    """down(swiglu(gate(x), up(x))) with gate and up as one product (`gate_up_proj`: gate's
    rows first, `gate_rows` of them)."""

    def __init__(self, gate_up_proj: nn.Module, down_proj: nn.Module, gate_rows: int) -> None:
        super().__init__()
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self.gate_rows = gate_rows

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = mx.split(self.gate_up_proj(x), [self.gate_rows], axis=-1)
        return self.down_proj(swiglu(gate, up))


def wanted() -> bool:
    """Whether load_model stacks a model's MLPs: MTPLX_STACKED_MLP=1 asks for it."""
    return os.environ.get(ENV, "") == "1"


def stack_mlps(model: nn.Module) -> int:
    """Replace every stackable MLP of `model` (MTP head included) by a StackedMLP; returns how
    many. Stackable: one of SWIGLU_MLPS whose gate and up are both plain nn.Linear without
    bias, or both affine nn.QuantizedLinear of one bit width and group size (not sharded)."""
    stacked = 0
    for parent in [m for _, m in model.named_modules()]:
        for name, child in list(parent.children().items()):
            if type(child) in SWIGLU_MLPS and (gate_up := _stacked_projection(child.gate_proj, child.up_proj)):
                mx.eval(gate_up.parameters())  # now, so the two parts' memory goes with them
                setattr(parent, name, StackedMLP(gate_up, child.down_proj, child.gate_proj.weight.shape[0]))
                stacked += 1
    return stacked


def _stacked_projection(gate: nn.Module, up: nn.Module) -> nn.Module | None:
    """gate and up as one layer, or None where they cannot be stacked."""
    if type(gate) is not type(up) or "bias" in gate or "bias" in up:
        return None
    if type(gate) is nn.Linear:
        out = nn.Linear(gate.weight.shape[1], 1, bias=False)
        out.weight = mx.concatenate([gate.weight, up.weight], axis=0)
        return out
    if (type(gate) is nn.QuantizedLinear and gate.mode == up.mode == "affine"
            and (gate.bits, gate.group_size) == (up.bits, up.group_size)):
        in_dims = gate.weight.shape[1] * 32 // gate.bits
        out = nn.QuantizedLinear(in_dims, 1, bias=False, group_size=gate.group_size, bits=gate.bits)
        for key in ("weight", "scales", "biases"):
            out[key] = mx.concatenate([gate[key], up[key]], axis=0)
        return out
    return None
