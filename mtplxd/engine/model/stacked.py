"""Projections that read the same input, served as one product (opt-in:
MTPLX_STACKED_PROJECTIONS=1): an MLP's gate and up; a Gated DeltaNet layer's in_proj_qkv, z,
b and a; an attention layer's q, k and v.

Why: on an H100 the hybrid 27B's 4-bit decode step was its quantized products, and a product
reads its weights faster the wider its matrix is (the tensor-core layout at 1 row: gate_proj,
17,408 rows, 36 us at 32% of the roofline; a GDN layer's 48-row in_proj_b 15 us, pure
latency; a 1,024-row k_proj 16 us; the 248k-row lm_head at 59%; docs/benchmarks.md, "Whole
steps on an H100"). Products that read the same input, stacked along the output dimension,
make one wide product. Off by default: on an H100 (2026-12-06, docs/benchmarks.md, "Stacked
projections in whole steps" and "The 32B's stacked decode step profiled") each group alone
was 17-55% faster (`bench.fused_products`), but whole steps (`bench.real_size --stacked`)
were not: the hybrid 27B 4-bit's decode 1-3% faster and its depth-3 cycle 3% slower; the
Qwen3-32B 4-bit's decode level on the wall (7% less device time under Nsight), its
mixed-routing verify forwards of 4-6 tokens 12-20% faster, and its depth-3 cycle, which an
MTP request runs, 5-11% slower in three processes and 12% faster in a fourth (6% less device
time under Nsight; "The 32B's AR step compiled, and the KV write that read the whole
buffer"): no steady gain on the wall yet.

How: the group's rows become one layer (`stacked_proj`, registered on the module that owns
the parts) and each part a `PartOf` it, under its own name, with no parameters of its own.
mlx-lm's forwards (and the engine's batched and captured ones) call the parts one after the
other on one input array; the first call computes the whole stacked product and keeps the
other parts' columns for their calls with that same array, so every caller gets one product
a group without knowing of the stacking, and the modules keep mlx-lm's classes and forwards.

Exactness: each output column of a quantized product is its own weight row's dot product with
the input, so the stacked product's columns are the parts' outputs; on the CPU backend
the quantized products are bit for bit equal (a test), and greedy MTP stays equal to AR
whatever is stacked (both run the same model). A float32 matmul through a BLAS need not be
(its blocking may change with the width): stacking is for quantized checkpoints served as
such.
"""

from __future__ import annotations

import itertools
import os
import threading

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3, qwen3_5, qwen3_next

ENV = "MTPLX_STACKED_PROJECTIONS"
STACKED = "stacked_proj"  # the attribute that holds a group's stacked layer
# (module types, the parts that read one input, in order): mlx-lm's swiglu MLPs (qwen3_5's
# is qwen3_next's), qwen3_5's GDN inputs, and qwen3's and qwen3_next/3_5's attention.
GROUPS: tuple[tuple[tuple[type, ...], tuple[str, ...]], ...] = (
    ((qwen3.MLP, qwen3_next.Qwen3NextMLP), ("gate_proj", "up_proj")),
    ((qwen3_5.GatedDeltaNet,), ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")),
    ((qwen3.Attention, qwen3_next.Qwen3NextAttention), ("q_proj", "k_proj", "v_proj")),
)


class _SharedProduct:
    """A stacked layer's product, computed once per input array for all of its parts (per
    thread: each thread's forward keeps its own)."""

    def __init__(self, layer: nn.Module, ends: list[int]) -> None:
        self.layer, self.ends = layer, ends
        self._memo = threading.local()

    def part(self, index: int, x: mx.array) -> mx.array:
        memo = self._memo
        if getattr(memo, "input", None) is not x or index not in memo.outputs:
            # A new input (or this part's columns already taken): one product for every part.
            memo.input = x
            memo.outputs = dict(enumerate(mx.split(self.layer(x), self.ends, axis=-1)))
        out = memo.outputs.pop(index)
        if not memo.outputs:  # every part served: hold no arrays past the group's calls
            memo.input = memo.outputs = None
        return out


class PartOf(nn.Module):
    """Part `index` of a stacked layer, as the layer it was: its columns of the stacked
    product (`_SharedProduct`), no parameters of its own (the model's bytes are counted
    once)."""

    def __init__(self, shared: _SharedProduct, index: int) -> None:
        super().__init__()
        self.index = index
        self._shared = lambda: shared  # a function: not registered as a child module

    def __call__(self, x: mx.array) -> mx.array:
        return self._shared().part(self.index, x)


def wanted() -> bool:
    """Whether load_model stacks a model's projections: MTPLX_STACKED_PROJECTIONS=1 asks."""
    return os.environ.get(ENV, "") == "1"


def stack(model: nn.Module) -> int:
    """Stack every group of GROUPS in `model` (MTP head included) whose parts stack and are
    not sharded; returns how many groups."""
    stacked = 0
    for _, module in model.named_modules():
        names = next((names for types, names in GROUPS if isinstance(module, types)), None)
        if names is None or STACKED in module or getattr(module, "sharding_group", None) is not None:
            continue
        stacked += stack_parts(module, names)  # a sharded part's class is not stackable either
    return stacked


def stack_parts(module: nn.Module, names: tuple[str, ...]) -> bool:
    """Replace `module`'s parts `names` by PartOf views of one stacked layer (held as
    `module.stacked_proj`); False (nothing changed) where they cannot be stacked."""
    parts = [module[name] for name in names]
    if (joined := stacked_projection(*parts)) is None:
        return False
    ends = list(itertools.accumulate(part.weight.shape[0] for part in parts))
    shared = _SharedProduct(joined, ends[:-1])
    module[STACKED] = joined
    for index, name in enumerate(names):
        setattr(module, name, PartOf(shared, index))
    return True


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
