"""The hybrid Qwen3.5/3.6/3.8 families: Gated DeltaNet + gated attention, with an MTP head.

Registers three `FamilySpec`s with `mtplxd.engine.model.families` when imported (the registry
imports this module lazily):

- ``qwen3_5``      Qwen3.5/3.6 dense (HF VLM layout: ``model.language_model.*`` + top-level ``mtp.*``)
- ``qwen3_5_moe``  Qwen3.5/3.6 MoE (same layout; experts fused as ``experts.gate_up_proj``)
- ``qwen3_next``   Qwen3-Next (flat ``model.*``; experts stored one by one)

What each spec supplies (see `FamilySpec` for the contract):

- ``build_mtp_layer(text_args)``: the MTP decoder layer, a *full gated-attention* layer
  (mlx-lm's own ``DecoderLayer`` built at a full-attention index) with the family's MLP or
  sparse-MoE block, chosen as vLLM does for ``mtp.layers.0``.
- ``norm_shift(raw_weights)``: True when mlx-lm's sanitize adds +1 to the trunk's
  zero-centred RMSNorm gains for this checkpoint (qwen3_5*: unconverted HF conv1d weights
  are present; qwen3_next: per-expert HF weights are present). The loader then shifts all
  7 MTP norms (pre_fc_norm_embedding, pre_fc_norm_hidden, mtp.norm, input/post-attention
  layernorm, q_norm, k_norm) the same way.
- ``make_cache(model)``: ``RollbackArraysCache`` for GDN layers (a working ``trim(n)``,
  see rollback.py) and ``KVCache`` for attention layers; enables GDN capture on the model.
- ``text_model`` / ``text_args``: unwrap the VLM wrapper (``model.language_model``).
- ``sanitize_mtp(weights)``: split/stack MoE expert tensors of ``mtp.layers.0.mlp`` into
  mlx-lm's ``switch_mlp`` names (names keep whatever prefix they came with).

Module-level helpers (the same functions, by model_type): ``FAMILIES`` (the three specs),
``build_mtp_layer(model_type, args)``, ``make_cache(model)``, ``norm_shift(model_type,
weights)``, ``sanitize_mtp_weights(weights)``, ``layer_types_refusal(config)`` (the loader
refuses a ``layer_types`` list mlx-lm would build wrong). Tiny random checkpoints of these
families are a fixture: `mtplxd.engine.fixtures.tiny_hybrid`.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_5, qwen3_next

from mtplxd.engine.model.families import FamilySpec, register_family
from mtplxd.engine.model.rollback import make_rollback_cache

HYBRID_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


# --- model structure -------------------------------------------------------------------


def _language_model(model: nn.Module) -> nn.Module:
    """qwen3_5* wrap the text model in a VLM `Model`; qwen3_next is the text model itself."""
    return getattr(model, "language_model", model)


def _qwen3_5_text_args(model_args: Any) -> qwen3_5.TextModelArgs:
    if isinstance(model_args, qwen3_5.TextModelArgs):
        return model_args
    return qwen3_5.TextModelArgs.from_dict(model_args.text_config)


def _identity(x: Any) -> Any:
    return x


def build_qwen3_5_mtp_layer(text_args: qwen3_5.TextModelArgs) -> nn.Module:
    """Full gated-attention decoder layer; MLP, or sparse MoE when the model has experts."""
    return qwen3_5.DecoderLayer(text_args, layer_idx=text_args.full_attention_interval - 1)


def build_qwen3_next_mtp_layer(args: qwen3_next.ModelArgs) -> nn.Module:
    """Full gated-attention decoder layer with the MLP/MoE choice vLLM makes for mtp.layers.0."""
    layer = qwen3_next.Qwen3NextDecoderLayer(args, layer_idx=args.full_attention_interval - 1)
    # vLLM derives the MLP kind from the layer's own index, which is 0 for mtp.layers.0.
    use_moe = args.num_experts > 0 and 0 not in args.mlp_only_layers and 1 % args.decoder_sparse_step == 0
    if use_moe and not isinstance(layer.mlp, qwen3_next.Qwen3NextSparseMoeBlock):
        layer.mlp = qwen3_next.Qwen3NextSparseMoeBlock(args)
    elif not use_moe and not isinstance(layer.mlp, qwen3_next.Qwen3NextMLP):
        layer.mlp = qwen3_next.Qwen3NextMLP(args.hidden_size, args.intermediate_size)
    return layer


def make_cache(model: nn.Module) -> list:
    """Trunk cache of a hybrid model: every entry has a working `trim(n)` (see rollback.py)."""
    return make_rollback_cache(model)


# --- weights ---------------------------------------------------------------------------


def _has_unconverted_conv1d(weights: Mapping[str, mx.array]) -> bool:
    # mlx-lm's qwen3_5 sanitize condition (qwen3_5.py:351): HF stores conv1d as (C, 1, K).
    return any("conv1d.weight" in k and v.shape[-1] != 1 for k, v in weights.items())


def _has_per_expert_weights(weights: Mapping[str, mx.array]) -> bool:
    # mlx-lm's qwen3_next sanitize only runs (and shifts norms) on the per-expert HF layout.
    return any(
        k.startswith("model.layers.") and k.endswith(".mlp.experts.0.up_proj.weight")
        for k in weights
    )


def norm_shift(model_type: str, weights: Mapping[str, mx.array]) -> bool:
    """True when mlx-lm shifts this checkpoint's trunk norms by +1 (so the MTP norms need it too).

    ``weights`` are the raw checkpoint tensors (trunk included): the decision depends on
    trunk tensors, exactly as mlx-lm's sanitize decides it.
    """
    if model_type in ("qwen3_5", "qwen3_5_moe"):
        return _has_unconverted_conv1d(weights)
    if model_type == "qwen3_next":
        return _has_per_expert_weights(weights)
    raise ValueError(f"not a hybrid family: {model_type}")


_FUSED_EXPERTS = re.compile(r"^(.*layers\.\d+\.mlp)\.experts\.(gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(.*layers\.\d+\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def sanitize_mtp_weights(weights: Mapping[str, mx.array]) -> dict[str, mx.array]:
    """Rename MoE expert tensors of the MTP block to mlx-lm's ``switch_mlp`` layout.

    - fused (Qwen3.5-MoE): ``…mlp.experts.gate_up_proj [E, 2I, H]`` -> ``switch_mlp.gate_proj``
      / ``up_proj`` (first / second half of dim 1); ``…experts.down_proj`` -> ``switch_mlp.down_proj``.
    - per expert (Qwen3-Next): ``…mlp.experts.{e}.{gate,up,down}_proj.weight`` stacked over e.
    Everything else is returned unchanged (names keep their prefix). Already-converted
    checkpoints (``switch_mlp`` names) pass through.
    """
    out: dict[str, mx.array] = {}
    per_expert: dict[tuple[str, str], dict[int, mx.array]] = {}
    for name, value in weights.items():
        if m := _FUSED_EXPERTS.match(name):
            prefix, kind = m.groups()
            if kind == "gate_up_proj":
                mid = value.shape[-2] // 2
                out[f"{prefix}.switch_mlp.gate_proj.weight"] = value[..., :mid, :]
                out[f"{prefix}.switch_mlp.up_proj.weight"] = value[..., mid:, :]
            else:
                out[f"{prefix}.switch_mlp.down_proj.weight"] = value
        elif m := _PER_EXPERT.match(name):
            prefix, expert, kind = m.groups()
            per_expert.setdefault((prefix, kind), {})[int(expert)] = value
        else:
            out[name] = value
    for (prefix, kind), experts in per_expert.items():
        if sorted(experts) != list(range(len(experts))):
            raise ValueError(f"{prefix}.experts: expert indices are not 0..{len(experts) - 1}")
        out[f"{prefix}.switch_mlp.{kind}.weight"] = mx.stack([experts[e] for e in range(len(experts))])
    return out


def check_layer_types(text_config: Mapping[str, Any]) -> None:
    """Raise ValueError when ``layer_types`` disagrees with ``full_attention_interval``.

    mlx-lm ignores ``layer_types`` and builds layer i as full attention iff
    ``(i + 1) % full_attention_interval == 0``; a non-periodic list would be built wrong.
    """
    layer_types = text_config.get("layer_types")
    if layer_types is None:
        return
    interval = text_config.get("full_attention_interval", 4)
    expected = [
        "linear_attention" if (i + 1) % interval else "full_attention"
        for i in range(text_config["num_hidden_layers"])
    ]
    if list(layer_types) != expected:
        raise ValueError(
            "config.json layer_types is not the periodic pattern of full_attention_interval="
            f"{interval}; mlx-lm cannot build this checkpoint correctly"
        )


def layer_types_refusal(config: Mapping[str, Any]) -> str | None:
    """Why a hybrid checkpoint's config.json cannot be built by mlx-lm, or None.

    Reads ``text_config`` when present (qwen3_5*), else the top level (qwen3_next).
    """
    text = config.get("text_config") or config
    try:
        check_layer_types(text)
    except ValueError as exc:
        return f"{exc}. Fix layer_types in config.json or use an unmodified checkpoint."
    return None


def _hybrid_spec(model_type: str, build_mtp_layer: Callable[[Any], nn.Module],
                 text_model: Callable[[Any], Any], text_args: Callable[[Any], Any]) -> FamilySpec:
    """The FamilySpec of one hybrid family: the cache, norm shift and MTP sanitizing are
    shared; the MTP layer and where the text model sits differ."""
    return FamilySpec(
        model_type=model_type,
        build_mtp_layer=build_mtp_layer,
        norm_shift=lambda w: norm_shift(model_type, w),
        make_cache=make_cache,
        text_model=text_model,
        text_args=text_args,
        sanitize_mtp=sanitize_mtp_weights,
    )


FAMILIES: dict[str, FamilySpec] = {spec.model_type: spec for spec in (
    _hybrid_spec("qwen3_5", build_qwen3_5_mtp_layer, _language_model, _qwen3_5_text_args),
    _hybrid_spec("qwen3_5_moe", build_qwen3_5_mtp_layer, _language_model, _qwen3_5_text_args),
    _hybrid_spec("qwen3_next", build_qwen3_next_mtp_layer, _identity, _identity),
)}

for _spec in FAMILIES.values():
    register_family(_spec)


def build_mtp_layer(model_type: str, args: Any) -> nn.Module:
    """The MTP decoder layer for ``model_type`` from the mlx-lm model args (nested or text)."""
    spec = FAMILIES[model_type]
    return spec.build_mtp_layer(spec.text_args(args))
