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
refuses a ``layer_types`` list mlx-lm would build wrong) and ``write_tiny_hybrid_checkpoint``
(tiny random HF-format checkpoints of each family, for tests and benchmarks).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable, Mapping

import mlx.core as mx
import mlx.nn as nn
import numpy as np
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


# --- tiny checkpoints ------------------------------------------------------------------

_TINY_TEXT: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "full_attention_interval": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "attn_output_gate": True,
    "torch_dtype": "float32",
}
_TINY_MOE: dict[str, Any] = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
}


def _tiny_config(family: str, vocab_size: int, with_mtp: bool, overrides: dict[str, Any]) -> dict[str, Any]:
    """config.json of a tiny checkpoint: the real checkpoints' layout (text_config for qwen3_5*)."""
    text = dict(_TINY_TEXT, vocab_size=vocab_size)
    if family in ("qwen3_5_moe", "qwen3_next"):
        text.update(_TINY_MOE)
    text.update(overrides)
    n, interval = text["num_hidden_layers"], text["full_attention_interval"]
    text.setdefault(
        "layer_types",
        ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)],
    )
    if family == "qwen3_next":
        text.setdefault("rope_theta", 10000000.0)
        text.setdefault("partial_rotary_factor", 0.25)
        text.setdefault("rope_scaling", None)
        if with_mtp:
            text.setdefault("num_nextn_predict_layers", 1)
        return {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", **text}
    text.setdefault(
        "rope_parameters",
        {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
         "mrope_section": [1, 1, 0], "mrope_interleaved": True},
    )
    text["model_type"] = f"{family}_text"
    if with_mtp:
        text.setdefault("mtp_num_hidden_layers", 1)
        text.setdefault("mtp_use_dedicated_embeddings", False)
    arch = "Qwen3_5MoeForConditionalGeneration" if family == "qwen3_5_moe" else "Qwen3_5ForConditionalGeneration"
    return {
        "architectures": [arch],
        "model_type": family,
        "tie_word_embeddings": text["tie_word_embeddings"],
        "text_config": text,
    }


class _TensorFactory:
    """Random tensors in HF layouts from one seeded generator (same seed, same bytes)."""

    def __init__(self, seed: int, dtype: mx.Dtype) -> None:
        self.rng = np.random.default_rng(seed)
        self.dtype = dtype
        self.tensors: dict[str, mx.array] = {}

    def put(self, name: str, value: np.ndarray, dtype: mx.Dtype | None = None) -> None:
        self.tensors[name] = mx.array(value.astype(np.float32)).astype(dtype or self.dtype)

    def linear(self, name: str, out_dim: int, in_dim: int) -> None:
        self.put(name, self.rng.normal(0.0, in_dim**-0.5, (out_dim, in_dim)))

    def zero_centred_norm(self, name: str, dim: int) -> None:
        # HF stores (1 + w) norms as w: small values around 0, shifted +1 at load.
        self.put(name, self.rng.normal(0.0, 0.1, (dim,)))

    def experts(self, name: str, shape: tuple[int, ...]) -> None:
        self.put(name, self.rng.normal(0.0, shape[-1] ** -0.5, shape))


def _attention_tensors(f: _TensorFactory, p: str, t: dict[str, Any]) -> None:
    H, nh, nkv, hd = t["hidden_size"], t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
    f.linear(f"{p}.self_attn.q_proj.weight", 2 * nh * hd, H)  # query + output gate
    f.linear(f"{p}.self_attn.k_proj.weight", nkv * hd, H)
    f.linear(f"{p}.self_attn.v_proj.weight", nkv * hd, H)
    f.linear(f"{p}.self_attn.o_proj.weight", H, nh * hd)
    f.zero_centred_norm(f"{p}.self_attn.q_norm.weight", hd)
    f.zero_centred_norm(f"{p}.self_attn.k_norm.weight", hd)


def _gdn_tensors(f: _TensorFactory, p: str, t: dict[str, Any], family: str) -> None:
    H = t["hidden_size"]
    Hk, Hv = t["linear_num_key_heads"], t["linear_num_value_heads"]
    key_dim, value_dim = Hk * t["linear_key_head_dim"], Hv * t["linear_value_head_dim"]
    conv_dim = 2 * key_dim + value_dim
    a = f"{p}.linear_attn"
    if family == "qwen3_next":
        f.linear(f"{a}.in_proj_qkvz.weight", 2 * key_dim + 2 * value_dim, H)
        f.linear(f"{a}.in_proj_ba.weight", 2 * Hv, H)
    else:
        f.linear(f"{a}.in_proj_qkv.weight", conv_dim, H)
        f.linear(f"{a}.in_proj_z.weight", value_dim, H)
        f.linear(f"{a}.in_proj_b.weight", Hv, H)
        f.linear(f"{a}.in_proj_a.weight", Hv, H)
    # HF/PyTorch depthwise Conv1d layout (C, 1, K); mlx-lm's sanitize moves it to (C, K, 1).
    K = t["linear_conv_kernel_dim"]
    f.put(f"{a}.conv1d.weight", f.rng.normal(0.0, K**-0.5, (conv_dim, 1, K)))
    f.put(f"{a}.dt_bias", 1.0 + f.rng.normal(0.0, 0.1, (Hv,)))
    f.put(f"{a}.A_log", np.log(f.rng.uniform(1.0, 16.0, (Hv,))), mx.float32)
    f.put(f"{a}.norm.weight", 1.0 + f.rng.normal(0.0, 0.1, (t["linear_value_head_dim"],)))
    f.linear(f"{a}.out_proj.weight", H, value_dim)


def _mlp_tensors(f: _TensorFactory, p: str, t: dict[str, Any], family: str) -> None:
    H = t["hidden_size"]
    m = f"{p}.mlp"
    if family == "qwen3_5":
        I = t["intermediate_size"]
        f.linear(f"{m}.gate_proj.weight", I, H)
        f.linear(f"{m}.up_proj.weight", I, H)
        f.linear(f"{m}.down_proj.weight", H, I)
        return
    E, Im, Is = t["num_experts"], t["moe_intermediate_size"], t["shared_expert_intermediate_size"]
    f.linear(f"{m}.gate.weight", E, H)
    if family == "qwen3_5_moe":  # fused experts, as transformers stores Qwen3.5-MoE
        f.experts(f"{m}.experts.gate_up_proj", (E, 2 * Im, H))
        f.experts(f"{m}.experts.down_proj", (E, H, Im))
    else:  # qwen3_next: one module per expert
        for e in range(E):
            f.linear(f"{m}.experts.{e}.gate_proj.weight", Im, H)
            f.linear(f"{m}.experts.{e}.up_proj.weight", Im, H)
            f.linear(f"{m}.experts.{e}.down_proj.weight", H, Im)
    f.linear(f"{m}.shared_expert.gate_proj.weight", Is, H)
    f.linear(f"{m}.shared_expert.up_proj.weight", Is, H)
    f.linear(f"{m}.shared_expert.down_proj.weight", H, Is)
    f.linear(f"{m}.shared_expert_gate.weight", 1, H)


_RESIDUAL_OUTPUTS = re.compile(
    r"(self_attn\.o_proj|linear_attn\.out_proj|down_proj|experts\.down_proj)(\.weight)?$"
)
DRAFT_FRIENDLY_RESIDUAL_SCALE = 0.15


def _make_draft_friendly(tensors: dict[str, mx.array], text: dict[str, Any], family: str) -> None:
    """Make the random model predictable enough that MTP drafts are often accepted.

    Every layer's contribution to the residual stream is scaled down, so the trunk is
    close to a bigram model (h_t ~ final_norm(embed(x_t))). The MTP head is set to compute
    the same thing from the token it is given: fc passes the normed embedding through,
    pre_fc_norm_embedding is 1 and mtp.norm equals the trunk's final norm. Drafts then match
    the trunk's greedy choice except where the (small) context-dependent part of the trunk
    tips the argmax: a mix of partial and full accepts, as the exactness tests need.
    """
    body = "model" if family == "qwen3_next" else "model.language_model"
    for name in list(tensors):
        if _RESIDUAL_OUTPUTS.search(name):
            tensors[name] = tensors[name] * DRAFT_FRIENDLY_RESIDUAL_SCALE
    if "mtp.fc.weight" in tensors:
        H = text["hidden_size"]
        dtype = tensors["mtp.fc.weight"].dtype
        tensors["mtp.fc.weight"] = mx.concatenate([mx.eye(H), mx.zeros((H, H))], axis=1).astype(dtype)
        tensors["mtp.pre_fc_norm_embedding.weight"] = mx.zeros((H,), dtype=dtype)
        tensors["mtp.norm.weight"] = tensors[f"{body}.norm.weight"]


def _hf_tensors(family: str, text: dict[str, Any], seed: int, with_mtp: bool, logit_scale: float) -> dict[str, mx.array]:
    """All tensors of a tiny checkpoint, in the real HF checkpoints' names and layouts."""
    dtype = getattr(mx, {"bfloat16": "bfloat16", "float16": "float16"}.get(text["torch_dtype"], "float32"))
    f = _TensorFactory(seed, dtype)
    H, V = text["hidden_size"], text["vocab_size"]
    body = "model" if family == "qwen3_next" else "model.language_model"
    tied = text["tie_word_embeddings"]
    # The scale sharpens the random model's next-token distributions (see tiny.write_tiny_checkpoint).
    # Tied: the embedding is also the lm_head. A large one lets x_t dominate the residual
    # stream, and a random tied model then just repeats x_t; this scale keeps it varied.
    tied_std = 0.25 * logit_scale * H**-0.5
    f.put(f"{body}.embed_tokens.weight", f.rng.normal(0.0, tied_std if tied else 1.0, (V, H)))
    for i in range(text["num_hidden_layers"]):
        p = f"{body}.layers.{i}"
        f.zero_centred_norm(f"{p}.input_layernorm.weight", H)
        f.zero_centred_norm(f"{p}.post_attention_layernorm.weight", H)
        if (i + 1) % text["full_attention_interval"]:
            _gdn_tensors(f, p, text, family)
        else:
            _attention_tensors(f, p, text)
        _mlp_tensors(f, p, text, family)
    f.zero_centred_norm(f"{body}.norm.weight", H)
    if not tied:
        f.put("lm_head.weight", f.rng.normal(0.0, logit_scale * H**-0.5, (V, H)))
    if with_mtp:
        f.linear("mtp.fc.weight", H, 2 * H)
        f.zero_centred_norm("mtp.pre_fc_norm_embedding.weight", H)
        f.zero_centred_norm("mtp.pre_fc_norm_hidden.weight", H)
        f.zero_centred_norm("mtp.norm.weight", H)
        f.zero_centred_norm("mtp.layers.0.input_layernorm.weight", H)
        f.zero_centred_norm("mtp.layers.0.post_attention_layernorm.weight", H)
        _attention_tensors(f, "mtp.layers.0", text)
        _mlp_tensors(f, "mtp.layers.0", text, family)
    return f.tensors


def _mlx_quantized_tensors(
    config: dict[str, Any], hf: dict[str, mx.array], bits: int, group_size: int
) -> dict[str, mx.array]:
    """The checkpoint as mlx-lm's converter would write it, MTP head included.

    Trunk: mlx-lm's sanitize (conv1d moved, norms shifted, experts stacked), then
    ``nn.quantize`` with the model's own quant predicate. MTP: the same conversion done by
    this module (experts to switch_mlp, +1 on the 7 norms when the trunk got it), built as
    an `MTPHead`, quantized alike and stored under ``mtp.*``.
    """
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    from mtplxd.engine.model.mtp_head import MTPHead, is_mtp_norm

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    model.load_weights(list(model.sanitize(dict(hf)).items()))

    spec = FAMILIES[config["model_type"]]
    args = spec.text_args(model.args)
    head = MTPHead(args.hidden_size, args.rms_norm_eps, spec.build_mtp_layer(args))
    shift = spec.norm_shift(hf)
    mtp = spec.sanitize_mtp({k: v for k, v in hf.items() if k.startswith("mtp.")})
    mtp = {k: (v + 1.0 if shift and is_mtp_norm(k) else v) for k, v in mtp.items()}
    head.load_weights([(k[len("mtp."):], v) for k, v in mtp.items()])

    def predicate(path: str, module: nn.Module):
        custom = model.quant_predicate(path, module) if getattr(model, "quant_predicate", None) else True
        if not hasattr(module, "to_quantized") or module.weight.shape[-1] % group_size:
            return False
        return custom

    nn.quantize(model, group_size=group_size, bits=bits, class_predicate=predicate)
    nn.quantize(head, group_size=group_size, bits=bits, class_predicate=predicate)
    config["quantization"] = {"group_size": group_size, "bits": bits}
    tensors = dict(tree_flatten(model.parameters()))
    tensors.update({f"mtp.{k}": v for k, v in tree_flatten(head.parameters())})
    return tensors


def write_tiny_hybrid_checkpoint(
    dest: Path | str,
    family: str,
    *,
    seed: int = 0,
    with_mtp: bool = True,
    quantize_bits: int | None = None,
    logit_scale: float = 4.0,
    draft_friendly: bool = True,
    **overrides: Any,
) -> Path:
    """Write a tiny random-weight checkpoint of a hybrid family into ``dest``; return ``dest``.

    Float checkpoints use the real HF layout, so loading exercises mlx-lm's sanitize path:
    qwen3_5/qwen3_5_moe nest the text config under ``text_config`` and store the trunk as
    ``model.language_model.*`` (MoE experts fused as ``experts.gate_up_proj``); qwen3_next
    is flat ``model.*`` with one tensor per expert. Conv1d weights are in PyTorch layout
    (C, 1, K) and RMSNorm gains are zero-centred (1+w), as HF checkpoints have them.
    ``layer_types`` is consistent with ``full_attention_interval``. With ``with_mtp`` the
    ``mtp.*`` tensors of engine.md 2.1 are written (MoE variants included).

    ``quantize_bits`` (4 or 8) writes the mlx-lm-converted form instead: MLX names, affine
    quantization with group size 32, ``"quantization"`` in config.json, MTP under ``mtp.*``
    already converted (norms shifted). ``overrides`` replace text-config keys (e.g.
    ``num_hidden_layers=8``, ``torch_dtype="bfloat16"``, ``tie_word_embeddings=True``).
    ``draft_friendly`` (default) shapes the random weights so that MTP drafts are often
    accepted (see ``_make_draft_friendly``), like the dense factory's fitted head; with
    False the weights are plain random and nearly every draft is rejected. (With
    ``tie_word_embeddings=True`` a draft-friendly model repeats one token: use False there.)
    Tokenizer files come from ``tiny.write_tiny_tokenizer``. Same seed, same bytes.
    """
    from mtplxd.engine.fixtures.tiny import EOS_TOKEN, PAD_TOKEN, _token_id, write_tiny_tokenizer

    if family not in HYBRID_MODEL_TYPES:
        raise ValueError(f"not a hybrid family: {family!r}; choose one of {HYBRID_MODEL_TYPES}")
    dest = Path(dest)
    vocab_size = write_tiny_tokenizer(dest)
    config = _tiny_config(family, overrides.pop("vocab_size", vocab_size), with_mtp, overrides)
    text = config.get("text_config", config)
    check_layer_types(text)
    tensors = _hf_tensors(family, text, seed, with_mtp, logit_scale)
    if draft_friendly:
        _make_draft_friendly(tensors, text, family)
    metadata = {"format": "pt"}
    if quantize_bits is not None:
        tensors = _mlx_quantized_tensors(config, tensors, quantize_bits, group_size=32)
        metadata = {"format": "mlx"}
    mx.save_safetensors(str(dest / "model.safetensors"), tensors, metadata=metadata)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    (dest / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [_token_id(dest, EOS_TOKEN), _token_id(dest, PAD_TOKEN)]}, indent=2))
    return dest
