"""Loading one rank's share of a checkpoint: its layers, plus the ends on rank 0.

The checkpoint is opened lazily (`load_checkpoint(lazy=True)`); the layers a rank does not
hold are replaced by None (as mlx-lm's PipelineMixin does) before anything is read, and so
are the ends (embedding, final norm, lm_head, MTP head) on a worker, which never runs them:
a rank reads and keeps only its own weights.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mtplxd.engine.model.families import FamilySpec
from mtplxd.engine.model.loader import parameter_bytes


def layer_count(config: dict[str, Any]) -> int:
    """The trunk's number of decoder layers (nested text configs included)."""
    text = config.get("text_config") or {}
    return int(config.get("num_hidden_layers") or text.get("num_hidden_layers") or 0)


def keep_only(spec: FamilySpec, start: int, end: int, *, ends: bool) -> Callable[[nn.Module], None]:
    """A `load_model(shard=...)` hook keeping layers [start, end) (and, with `ends`, the
    embeddings, final norm, lm_head and MTP head) and reading exactly those weights."""
    def shard(model: nn.Module) -> None:
        layers = spec.text_model(model).model.layers
        for i in range(len(layers)):
            if not start <= i < end:
                layers[i] = None
        if not ends:
            drop_ends(spec, model)
        mx.eval([m.parameters() for m in held_modules(spec, model, start, end, ends=ends)])
    return shard


def drop_ends(spec: FamilySpec, model: nn.Module) -> None:
    """Drop, unread, what only rank 0 runs: the embedding, final norm, lm_head and MTP head
    (rank 0 embeds, applies the norm and the heads for the whole group in both modes)."""
    text = spec.text_model(model)
    text.model.embed_tokens = text.model.norm = None
    if getattr(text, "lm_head", None) is not None:
        text.lm_head = None
    if getattr(model, "mtp", None) is not None:
        model.mtp = None


def parameter_groups(model: nn.Module) -> list[str]:
    """The names of a model's parameters with the layer index and what follows it cut off
    (`model.layers.3.mlp.up_proj.weight` -> `model.layers`): what kinds of weight it holds."""
    return sorted({re.sub(r"\.layers\.\d+\..*", ".layers", name)
                   for name, _ in tree_flatten(model.parameters())})


def held_modules(spec: FamilySpec, model: nn.Module, start: int, end: int, *,
                 ends: bool) -> list[nn.Module]:
    """The modules a rank holding layers [start, end) (and the ends, with `ends`) keeps."""
    text = spec.text_model(model)
    modules = list(text.model.layers[start:end])
    if ends:
        modules += [text.model.embed_tokens, text.model.norm,
                    getattr(text, "lm_head", None), getattr(model, "mtp", None)]
    return [m for m in modules if isinstance(m, nn.Module)]


def resident_bytes(modules: list[nn.Module]) -> int:
    """Bytes of the parameters of `modules` (what a rank holds)."""
    return sum(parameter_bytes(m) for m in modules)


def physical_memory() -> int:
    """This machine's physical memory in bytes (what the split is proportional to), as the
    memory guard reads it (psutil)."""
    import psutil

    return psutil.virtual_memory().total
