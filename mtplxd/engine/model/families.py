"""The registry of model families that have an MTP head, as small spec objects.

A family says how to build its MTP decoder layer, whether the checkpoint's MTP norms are
zero-centred (HF `(1+w)` convention, shifted by +1 at load like the trunk's), how to make the
trunk cache, and where the text model sits inside mlx-lm's `Model`. Any other `model_type`
mlx-lm can load is served plain autoregressive (AR).

Dense `qwen3` is registered here. The hybrid Gated-DeltaNet families (`qwen3_5`,
`qwen3_5_moe`, `qwen3_next`) register themselves from `mtplxd.engine.model.hybrid`, imported lazily
the first time the registry is consulted.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

log = logging.getLogger(__name__)


def default_make_cache(model: nn.Module) -> list:
    """mlx-lm's own cache for the trunk (the model's `make_cache`, else one KVCache a layer)."""
    return make_prompt_cache(model)


def _identity(x: Any) -> Any:
    return x


def _never(weights: Mapping[str, mx.array]) -> bool:
    return False


@dataclass(frozen=True)
class FamilySpec:
    """How one `model_type` gets its MTP head.

    build_mtp_layer(text_args) -> a full-attention decoder layer callable as
        `layer(x, mask, cache)`; its parameter names must equal the checkpoint's
        `mtp.layers.0.*` names (after `sanitize_mtp`).
    norm_shift(raw_weights) -> True when the checkpoint stores zero-centred RMSNorm gains
        that mlx-lm shifts by +1 at sanitize; the loader then shifts all MTP norms too.
    make_cache(model) -> the trunk cache list; every entry must support `trim(n)`.
    text_model(model) -> the module with `.model` (embed_tokens, layers, norm -> post-norm
        hidden) and `.lm_head` or tied embeddings (`.args.tie_word_embeddings`).
    text_args(model_args) -> the args object of the text model (nested configs).
    sanitize_mtp(mtp_weights) -> the `mtp.*` weights renamed/split to the module's names.
    """

    model_type: str
    build_mtp_layer: Callable[[Any], nn.Module]
    norm_shift: Callable[[Mapping[str, mx.array]], bool] = _never
    make_cache: Callable[[nn.Module], list] = default_make_cache
    text_model: Callable[[nn.Module], nn.Module] = _identity
    text_args: Callable[[Any], Any] = _identity
    sanitize_mtp: Callable[[dict], dict] = _identity


_REGISTRY: dict[str, FamilySpec] = {}
_PLUGINS = ("mtplxd.engine.model.hybrid",)
_plugins_loaded = False


def register_family(spec: FamilySpec) -> None:
    """Add (or replace) the spec for `spec.model_type`."""
    _REGISTRY[spec.model_type] = spec


def _load_plugins() -> None:
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for name in _PLUGINS:
        if importlib.util.find_spec(name) is None:
            continue
        try:
            importlib.import_module(name)
        except Exception:  # a broken plugin must not take the dense families down with it
            log.exception("could not import model-family plugin %s", name)


def get_family(model_type: str) -> FamilySpec | None:
    """The registered spec for `model_type`, or None (served AR)."""
    _load_plugins()
    return _REGISTRY.get(model_type)


def registered_families() -> list[str]:
    """Every model_type with an MTP head, sorted."""
    _load_plugins()
    return sorted(_REGISTRY)


# Families mlx-lm serves whose checkpoints carry no MTP head to draft with, and why: the
# reason `status`, `/health` and `mtplxctl models check` give for serving them AR.
AR_FAMILY_REASONS = {
    "lfm2": ("LFM2/LFM2.5 checkpoints carry no MTP head (LiquidAI ships none); serving plain "
             "autoregressive"),
    "lfm2_moe": ("LFM2 MoE checkpoints carry no MTP head (LiquidAI ships none); serving plain "
                 "autoregressive"),
}


def ar_reason(model_type: str) -> str:
    """Why a model type without a registered MTP family is served AR."""
    return AR_FAMILY_REASONS.get(
        model_type, f"model type {model_type!r} has no MTP support in mtplx; serving plain autoregressive")


def _qwen3_layer(args: Any) -> nn.Module:
    from mlx_lm.models.qwen3 import TransformerBlock

    return TransformerBlock(args)


register_family(FamilySpec(model_type="qwen3", build_mtp_layer=_qwen3_layer))
