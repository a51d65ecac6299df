"""Projections that read the same input, served as one product: an MLP's gate and up, and a
Gated DeltaNet layer's in_proj_qkv, z, b and a (opt-in: MTPLX_STACKED_PROJECTIONS=1).

Why: on an H100 the hybrid 27B's 4-bit decode step was its quantized products, and a product
reads its weights faster the wider its matrix is (the tensor-core layout at 1 row: gate_proj,
17,408 rows, 36 us at 32% of the roofline; a GDN layer's 48-row in_proj_b 15 us, pure
latency; the 248k-row lm_head at 59%; docs/benchmarks.md, "Whole steps on an H100"). Products
that read the same input, stacked along the output dimension, make one wide product. Off by
default until the GPU measures it in whole steps (`bench.fused_products` for the products
alone, `bench.real_size --stacked` for the steps).

A GDN layer's four parts stay reachable by name (`RowsOf`: the stacked layer's rows, no
parameters of their own) for mlx-lm's own forward, which the engine still runs for masked
cohort rows and long CPU prompts; the engine's captured forward takes the stacked product
(rollback.RollbackGatedDeltaNet._project, `gdn_inputs`).

Exactness: each output column of a quantized product is its own weight row's dot product with
the input, so the stacked product's columns are the parts' outputs; on the CPU backend
the quantized products are bit for bit equal (a test), and greedy MTP stays equal to AR
whatever is stacked (both run the same model). A float32 matmul through a BLAS need not be
(its blocking may change with the width): stacking is for quantized checkpoints served as
such.
"""

from __future__ import annotations

import os

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3, qwen3_5, qwen3_next
from mlx_lm.models.activations import swiglu

ENV = "MTPLX_STACKED_PROJECTIONS"
# mlx-lm's MLPs that compute down(swiglu(gate(x), up(x))); qwen3_5's is qwen3_next's.
SWIGLU_MLPS = (qwen3.MLP, qwen3_next.Qwen3NextMLP)
GDN_INPUTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")  # qwen3_5's GDN, in order


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


class RowsOf(nn.Module):
    """Rows [start, end) of a stacked layer, as the layer they were: a view of its weights at
    each call, no parameters of its own (the model's bytes are counted once)."""

    def __init__(self, stacked: nn.Module, start: int, end: int) -> None:
        super().__init__()
        self.start, self.end = start, end
        self._stacked = lambda: stacked  # a function: not registered as a child module

    def __call__(self, x: mx.array) -> mx.array:
        layer, rows = self._stacked(), slice(self.start, self.end)
        if "scales" not in layer:
            return x @ layer["weight"][rows].T
        return mx.quantized_matmul(x, layer["weight"][rows], layer["scales"][rows], layer["biases"][rows],
                                   transpose=True, group_size=layer.group_size, bits=layer.bits)


def wanted() -> bool:
    """Whether load_model stacks a model's projections: MTPLX_STACKED_PROJECTIONS=1 asks."""
    return os.environ.get(ENV, "") == "1"


def stack(model: nn.Module) -> int:
    """Stack every stackable MLP and GDN input of `model`; returns how many groups."""
    return stack_mlps(model) + stack_gdn_inputs(model)


def stack_gdn_inputs(model: nn.Module) -> int:
    """Give every qwen3_5 GDN layer of `model` (not sharded) whose four input projections
    stack an `in_proj_stacked` layer, and its four parts `RowsOf` it; returns how many."""
    stacked = 0
    for _, module in model.named_modules():
        if not isinstance(module, qwen3_5.GatedDeltaNet) or getattr(module, "sharding_group", None) is not None:
            continue
        parts = [module[name] for name in GDN_INPUTS]
        if (joined := stacked_projection(*parts)) is None:
            continue
        module.in_proj_stacked = joined
        start = 0
        for name, part in zip(GDN_INPUTS, parts):
            rows = part.weight.shape[0]
            setattr(module, name, RowsOf(joined, start, start + rows))
            start += rows
        stacked += 1
    return stacked


def gdn_inputs(module: nn.Module, inputs: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """A stacked GDN layer's (qkv, z, b, a) from one product (z not yet split into heads)."""
    ends = [module[name].end for name in GDN_INPUTS[:-1]]
    qkv, z, b, a = mx.split(module.in_proj_stacked(inputs), ends, axis=-1)
    return qkv, z, b, a


def stack_mlps(model: nn.Module) -> int:
    """Replace every stackable MLP of `model` (MTP head included) by a StackedMLP; returns how
    many. Stackable: one of SWIGLU_MLPS whose gate and up are both plain nn.Linear without
    bias, or both affine nn.QuantizedLinear of one bit width and group size (not sharded)."""
    stacked = 0
    for parent in [m for _, m in model.named_modules()]:
        for name, child in list(parent.children().items()):
            if type(child) in SWIGLU_MLPS and (gate_up := stacked_projection(child.gate_proj, child.up_proj)):
                setattr(parent, name, StackedMLP(gate_up, child.down_proj, child.gate_proj.weight.shape[0]))
                stacked += 1
    return stacked


def stacked_projection(*parts: nn.Module) -> nn.Module | None:
    """The parts as one layer, evaluated (their rows in order: for quantized parts the same
    values, scales and biases group for group), or None where they cannot be stacked: all
    plain nn.Linear, or all affine nn.QuantizedLinear of one bit width and group size, none
    with a bias."""
    first = parts[0]
    if any(type(p) is not type(first) or "bias" in p for p in parts):
        return None
    if type(first) is nn.Linear:
        out = nn.Linear(first.weight.shape[1], 1, bias=False)
        out.weight = mx.concatenate([p.weight for p in parts], axis=0)
    elif type(first) is nn.QuantizedLinear and all(
            (p.mode, p.bits, p.group_size) == ("affine", first.bits, first.group_size) for p in parts):
        in_dims = first.weight.shape[1] * 32 // first.bits
        out = nn.QuantizedLinear(in_dims, 1, bias=False, group_size=first.group_size, bits=first.bits)
        for key in ("weight", "scales", "biases"):
            out[key] = mx.concatenate([p[key] for p in parts], axis=0)
    else:
        return None
    mx.eval(out.parameters())  # now, so the parts' memory goes with them once dropped
    return out
