"""Checkpoint inspection and loading: the trunk through mlx-lm, the MTP head kept beside it.

mlx-lm's `sanitize` drops every `mtp.*` tensor (or, for dense qwen3, would fail on them), so
the loader subclasses the family's mlx-lm `Model`: the subclass owns an `mtp` MTPHead, pulls
the `mtp.*` tensors out before the original sanitize runs, shifts their zero-centred norms
when the family's trunk norms get shifted, and hands them back. mlx-lm's own quantize and
strict `load_weights` then cover trunk and head alike (MLX-quantized heads included).
"""

from __future__ import annotations

import json
import logging
import os
import struct
from pathlib import Path
from typing import Any

from mtplxd.engine.interface import CheckpointReport, ModelLoadError

log = logging.getLogger(__name__)

SUPPORTED_BITS = (4, 8)
DEFAULT_DEPTH = 3
# A checkpoint may name the depth its head was tuned for (config.json "mtplx_default_depth").
RECOMMENDED_DEPTH_KEY = "mtplx_default_depth"
# ... and another for CUDA ("mtplx_cuda_default_depth"). There a small model's decode is bound
# by the host building and launching each step's kernels, not by the device, so a cycle's
# cost grows slowly with depth and deeper drafts pay off where on the CPU they do not.
CUDA_DEPTH_KEY = "mtplx_cuda_default_depth"
# A checkpoint may ask to be served quantized on CUDA (config.json, e.g. {"bits": 8,
# "group_size": 64}). There a matmul over 2-5 rows of bf16 weights runs a gemm that costs
# about twice the 1-row gemv, while MLX's quantized matmul serves 1-8 rows with one kernel
# of the gemv's cost: a speculative verify then costs what a decode step costs. On the CPU
# quantized matmuls are ~10x slower than bf16 ones, so the shipped file stays bf16.
CUDA_QUANTIZATION_KEY = "mtplx_cuda_quantization"
LOAD_QUANTIZE_GROUP_SIZE = 64


MAX_DEPTH = 8


# Why a quantized model whose weights stay packed on the CPU backend (dequantize_wanted said
# no) decodes AR unless asked otherwise: MLX's CPU quantized matmul loops over its rows, so a
# verify of K+1 tokens costs about K+1 decode steps, and MTP only slows the model down (the
# embedded model quantized to 4-bit on the Linux CPU: MTP/AR 0.71x at depth 3, 0.88x at depth
# 1; docs/benchmarks.md, "Quantized checkpoints on the Linux CPU").
QUANTIZED_CPU_DEPTH_REASON = (
    "quantized weights kept packed on the CPU (the dequantize setting): MLX's quantized matmul "
    "costs every row of a verify what a decode step costs, so MTP decodes slower than AR here; "
    "set a depth to use it anyway")


def default_depth(config: dict[str, Any], on_cuda: bool, quantized_on_cpu: bool) -> tuple[int, str | None]:
    """The depth a model is served at when none is asked for, and why it is 0 where MTP would
    cost more than it saves (None otherwise): QUANTIZED_CPU_DEPTH_REASON for quantized
    weights on the CPU backend, else `recommended_depth`."""
    if quantized_on_cpu:
        return 0, QUANTIZED_CPU_DEPTH_REASON
    return recommended_depth(config, on_cuda), None


def recommended_depth(config: dict[str, Any], on_cuda: bool = False) -> int:
    """The checkpoint's own recommended MTP depth (on CUDA its CUDA_DEPTH_KEY, when it names
    one), else DEFAULT_DEPTH."""
    keys = (CUDA_DEPTH_KEY, RECOMMENDED_DEPTH_KEY) if on_cuda else (RECOMMENDED_DEPTH_KEY,)
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_DEPTH:
            return value
    return DEFAULT_DEPTH


def _read_config(path: Path) -> dict[str, Any]:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{path} has no config.json; point at a Hugging Face-format model folder")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{config_file} is not valid JSON: {exc}") from exc


def weight_files(path: Path) -> list[Path]:
    """The safetensors shards mlx-lm would load (`model*.safetensors`), sorted."""
    return sorted(path.glob("model*.safetensors"))


def safetensors_header(file: Path) -> dict[str, Any]:
    """One safetensors file's tensors, name -> {"dtype", "shape", "data_offsets"}, read from
    its header only (no weight is read)."""
    with open(file, "rb") as handle:
        (size,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(size))
    header.pop("__metadata__", None)
    return header


def safetensors_names(file: Path) -> list[str]:
    """Tensor names in one safetensors file, read from its header only."""
    return list(safetensors_header(file))


def mtp_layer_count(config: dict[str, Any]) -> int:
    """MTP layers declared by the config (`mtp_num_hidden_layers` or `num_nextn_predict_layers`)."""
    text = config.get("text_config") or {}
    for source in (config, text):
        for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
            if source.get(key):
                return int(source[key])
    return 0


def quantization_label(config: dict[str, Any]) -> str | None:
    """"4bit"/"8bit"/... for MLX-quantized checkpoints, the method name for others, else None."""
    quant = config.get("quantization")
    if quant:
        mode = quant.get("mode", "affine")
        return f"{quant.get('bits')}bit" + ("" if mode == "affine" else f"-{mode}")
    qc = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if qc:
        return str(qc.get("quant_method", "unknown"))
    return None


def quantization_refusal(config: dict[str, Any]) -> str | None:
    """Why this checkpoint's quantization cannot be served, or None when it can."""
    quant = config.get("quantization")
    if quant:
        specs = [("the model", quant)] + [
            (name, spec) for name, spec in quant.items() if isinstance(spec, dict)
        ]
        for where, spec in specs:
            bits, mode = spec.get("bits"), spec.get("mode", "affine")
            if mode != "affine" or bits not in SUPPORTED_BITS:
                return (f"{bits}-bit {mode} quantization ({where}) is not supported; mtplx serves "
                        f"MLX affine 4-bit and 8-bit weights or unquantized bf16/fp16/fp32. "
                        f"Re-convert with `mlx_lm.convert --hf-path ORIGINAL -q --q-bits 4`.")
        return None
    qc = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if qc:
        method = qc.get("quant_method", "unknown")
        bits = qc.get("bits") or qc.get("num_bits") or "unknown"
        return (f"{method} quantization ({bits}-bit) is not supported; mtplx serves MLX affine "
                f"4-bit and 8-bit weights. Convert with `mlx_lm.convert --hf-path ORIGINAL -q`.")
    return None


def refusal_reason(path: Path, config: dict[str, Any]) -> str | None:
    """Why the checkpoint is refused outright (bundled code, quantization, no weights)."""
    if config.get("auto_map") or config.get("model_file"):
        return ("the checkpoint ships its own Python code (auto_map); mtplx never runs repository "
                "code. Use a checkpoint of a model type mlx-lm supports natively.")
    if "model_type" not in config:
        return "config.json has no model_type"
    reason = quantization_refusal(config)
    if reason:
        return reason
    if config["model_type"] in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        from mtplxd.engine.model.hybrid import layer_types_refusal  # mlx-lm ignores layer_types

        if reason := layer_types_refusal(config):
            return reason
    if not weight_files(path):
        return f"no model*.safetensors weights in {path}; download the full checkpoint"
    return None


def _mlx_lm_supports(model_type: str) -> bool:
    from mlx_lm.utils import _get_classes

    try:
        _get_classes({"model_type": model_type})
    except ValueError:
        return False
    return True


def inspect_checkpoint(path: str | os.PathLike) -> CheckpointReport:
    """Describe a checkpoint folder from config.json and safetensors headers (no weights read).

    mode is "mtp" (a registered family with its MTP tensors), "ar" (served plain
    autoregressive; reason says why) or "refused" (reason says what to do).
    """
    from mtplxd.engine.model.families import get_family

    path = Path(path)
    config = _read_config(path)
    files = weight_files(path)
    weights_bytes = sum(f.stat().st_size for f in files)
    names = [n for f in files for n in safetensors_names(f)]
    has_mtp = any(n.startswith("mtp.") for n in names)
    model_type = config.get("model_type", "")
    text = config.get("text_config") or {}
    context = config.get("max_position_embeddings") or text.get("max_position_embeddings")
    spec = get_family(model_type)
    mode, reason = mtp_mode(config, spec is not None, has_mtp)
    refused = refusal_reason(path, config)
    if refused is None and not _mlx_lm_supports(model_type):
        refused = f"model type {model_type!r} is not supported by mlx-lm {_mlx_lm_version()}"
    if refused is not None:
        mode, reason = "refused", refused
    from mtplxd.engine.model.vision import has_vision_config, vision_refusal

    vision_reason = vision_refusal(config)
    if has_vision_config(config) and vision_reason is None \
            and not any(n.startswith(("model.visual.", "vision_tower.")) for n in names):
        vision_reason = "config.json has vision_config but the weights hold no vision tower; serving text only"
    return CheckpointReport(
        path=str(path), model_type=model_type, family=model_type if spec else None, mode=mode,
        reason=reason, quantization=quantization_label(config), has_mtp_tensors=has_mtp,
        weights_bytes=weights_bytes, context_length=context,
        vision=has_vision_config(config) and vision_reason is None and mode != "refused",
        vision_reason=vision_reason,
    )


def mtp_mode(config: dict[str, Any], registered: bool, has_mtp_tensors: bool) -> tuple[str, str | None]:
    """("mtp", None) or ("ar", why) for a loadable checkpoint."""
    model_type = config.get("model_type")
    if not registered:
        from mtplxd.engine.model.families import ar_reason

        if has_mtp_tensors:  # a head mtplx cannot build yet: say so rather than "none shipped"
            return "ar", (f"the checkpoint has mtp.* tensors, but mtplx has no MTP layer for model "
                          f"type {model_type!r} yet; serving plain autoregressive")
        return "ar", ar_reason(str(model_type))
    layers = mtp_layer_count(config)
    if not has_mtp_tensors:
        return "ar", ("the checkpoint has no mtp.* tensors (mlx-lm conversions drop them); "
                      "serving plain autoregressive. Use the original HF weights or a conversion "
                      "that keeps the MTP head.")
    if layers == 0:
        return "ar", "config.json declares no MTP layers (mtp_num_hidden_layers); serving plain autoregressive"
    if layers != 1:
        return "ar", f"{layers} MTP layers are not supported (mtplx uses exactly 1); serving plain autoregressive"
    return "mtp", None


def _mlx_lm_version() -> str:
    import mlx_lm

    return getattr(mlx_lm, "__version__", "?")


def _model_classes_with_mtp(spec, config: dict[str, Any]):
    """mlx-lm's (Model, ModelArgs) for `config`, the Model subclassed to own an MTP head."""
    from mlx_lm.utils import _get_classes

    from mtplxd.engine.model.mtp_head import MTPHead, is_mtp_norm

    base_class, args_class = _get_classes(config)

    class ModelWithMTP(base_class):  # type: ignore[misc, valid-type]
        def __init__(self, args: Any) -> None:
            super().__init__(args)
            text_args = spec.text_args(args)
            self.mtp = MTPHead(text_args.hidden_size, text_args.rms_norm_eps,
                               spec.build_mtp_layer(text_args))

        def sanitize(self, weights: dict) -> dict:
            mtp = {k: v for k, v in weights.items() if k.startswith("mtp.")}
            shift = spec.norm_shift(weights)
            trunk = super().sanitize({k: v for k, v in weights.items() if not k.startswith("mtp.")})
            mtp = spec.sanitize_mtp(mtp)
            if shift:
                mtp = {k: (v + 1.0 if is_mtp_norm(k) else v) for k, v in mtp.items()}
            trunk.update(mtp)
            return trunk

    return lambda config: (ModelWithMTP, args_class)


def load_checkpoint(path: Path, *, with_mtp: bool, lazy: bool = False):
    """Load (model, config, tokenizer) from a folder that `refusal_reason` accepted.

    With `with_mtp`, the returned model has an `.mtp` MTPHead loaded strictly from the
    checkpoint's `mtp.*` tensors; without it, those tensors are dropped before mlx-lm sees them.
    With `lazy`, no weight is read yet (a pipeline rank evaluates only its own layers).
    """
    from mlx_lm.utils import load_config, load_model, load_tokenizer

    from mtplxd.engine.model.families import get_family

    config = load_config(path)
    spec = get_family(config["model_type"])
    if with_mtp:
        getter = _model_classes_with_mtp(spec, config)
    else:
        getter = _drop_mtp_classes(config)
    try:
        model, config = load_model(path, lazy=lazy, get_model_classes=getter)
        tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except (ValueError, FileNotFoundError, KeyError) as exc:
        raise ModelLoadError(f"could not load {path}: {exc}") from exc
    return model, config, tokenizer


def quantize_on_load(model, config: dict[str, Any], choice: str, on_cuda: bool) -> str | None:
    """Quantize an unquantized model in place as `choice` asks; return the label applied.

    "auto" applies the checkpoint's CUDA_QUANTIZATION_KEY when `on_cuda`; "8bit"/"4bit"
    always apply (group size 64); "none" never. A checkpoint that is already quantized is
    left as it is. Linear and embedding layers of trunk and MTP head are quantized alike
    (layers whose input width the group size does not divide stay as they are).
    """
    import mlx.nn as nn

    if config.get("quantization") or config.get("quantization_config"):
        return None
    if choice == "auto":
        wanted = config.get(CUDA_QUANTIZATION_KEY) if on_cuda else None
        if not wanted:
            return None
        bits, group_size = int(wanted["bits"]), int(wanted.get("group_size", LOAD_QUANTIZE_GROUP_SIZE))
    elif choice in ("8bit", "4bit"):
        bits, group_size = int(choice[0]), LOAD_QUANTIZE_GROUP_SIZE
    else:
        return None
    if bits not in SUPPORTED_BITS:
        raise ModelLoadError(f"{CUDA_QUANTIZATION_KEY}: {bits}-bit is not supported; use 4 or 8")

    def quantizable(_path: str, module) -> bool:
        weight = getattr(module, "weight", None)
        return (hasattr(module, "to_quantized") and weight is not None
                and weight.shape[-1] % group_size == 0)

    nn.quantize(model, group_size=group_size, bits=bits, class_predicate=quantizable)
    return f"{bits}bit, at load"


def compute_dtype(system: str, on_cpu: bool) -> str | None:
    """The dtype to upcast a model's floating parameters to at load, or None to keep the
    checkpoint's.

    float32 on the Linux CPU backend: MLX's CPU matmul has a BLAS path (cblas_sgemm, an
    optimized BLAS through mtplxd.blas) only for float32; bfloat16 and float16 matmuls run a
    plain loop at a few GFLOP/s. Quantized checkpoints too: their packed weights stay as they
    are, and their scales, biases, norms and activations become float32, because MLX's CPU
    quantized matmul computes in the activations' dtype. A 4-bit 4096x2560 product of one
    row took 72 ms with bfloat16 activations and scales on a 2-core Linux VM, 9.2 ms with
    float32 (docs/benchmarks.md, "Quantized checkpoints on the Linux CPU"). Metal (macOS)
    and CUDA compute half-precision natively and keep the checkpoint's dtype.
    """
    if system.startswith("linux") and on_cpu:
        return "float32"
    return None


# Where a quantized model's weights fit as dense float32, the Linux CPU serves them so:
# OpenBLAS streams float32 weights faster than MLX's CPU quantized matmul unpacks packed ones,
# and a product of several rows costs little more than one row, so MTP pays again. Qwen3-0.6B's
# dims at 4-bit, one token: 538 ms packed, 249 ms dense; 4 tokens 2,103 ms against 315
# (docs/benchmarks.md, "Quantized checkpoints dequantized on the Linux CPU"). The price is
# memory: 8x the packed weights at 4-bit, 4x at 8-bit, so "auto" does it only while the dense
# weights take at most this share of the memory limit, the rest left to the KV cache and the
# session bank, and only for checkpoints that ship quantized (one quantized as it loads was
# asked to be).
DEQUANTIZE_MEMORY_SHARE = 0.5


def dense_float32_bytes(model) -> int | None:
    """Bytes of `model`'s parameters with every quantized layer dense float32, or None when
    one has no dense twin here (only nn.QuantizedLinear and nn.QuantizedEmbedding do; a
    mixture-of-experts' quantized experts do not)."""
    import mlx.nn as nn

    total = parameter_bytes(model)
    for _, module in model.named_modules():
        if "scales" not in module:
            continue
        if type(module) not in (nn.QuantizedLinear, nn.QuantizedEmbedding) or module.mode != "affine":
            return None
        rows, packed_columns = module["weight"].shape
        packed = sum(module[name].nbytes for name in ("weight", "scales", "biases") if name in module)
        total += rows * (packed_columns * 32 // module.bits) * 4 - packed
    return total


def dequantize_wanted(choice: str, dense_bytes: int | None, memory_bytes: int,
                      quantized_at_load: bool = False) -> bool:
    """Whether a quantized model computed in float32 gets dense float32 weights: `choice`
    "on" whenever it can (`dense_bytes` known) and they fit in `memory_bytes` (the memory
    limit) at all, "off" never, "auto" while they take at most DEQUANTIZE_MEMORY_SHARE of it,
    and not for a model `quantized_at_load`: that was asked for (the `quantize` setting)."""
    if dense_bytes is None or choice == "off":
        return False
    if choice == "on":
        return dense_bytes <= memory_bytes
    return not quantized_at_load and dense_bytes <= DEQUANTIZE_MEMORY_SHARE * memory_bytes


def dequantize(model) -> None:
    """Replace every quantized linear and embedding layer of `model` (trunk and MTP head) with
    its dense float32 twin, in place (`dense_float32_bytes` says what it will hold). Each
    weight is `mx.dequantize` of its packed values: scale * q + bias in float32."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_map_with_path

    def dense(_path: str, module):
        if type(module) not in (nn.QuantizedLinear, nn.QuantizedEmbedding):
            return module
        weight = mx.dequantize(module["weight"], module["scales"], module.get("biases"),
                               group_size=module.group_size, bits=module.bits).astype(mx.float32)
        if isinstance(module, nn.QuantizedEmbedding):
            twin = nn.Embedding(*weight.shape)
        else:
            twin = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in module)
            if "bias" in module:
                twin.bias = module["bias"].astype(mx.float32)
        twin.weight = weight
        # Evaluated layer by layer, so no graph of the whole model builds up; the packed weights
        # are freed when the model takes the twins (the peak: dense plus packed weights).
        mx.eval(twin.parameters())
        return twin

    model.update_modules(tree_map_with_path(dense, model.leaf_modules(), is_leaf=nn.Module.is_module))


def upcast(model, dtype: str) -> None:
    """Cast every floating parameter of `model` (trunk and MTP head) to `dtype` in place."""
    import mlx.core as mx

    model.set_dtype(getattr(mx, dtype))


def parameter_bytes(model) -> int:
    """Bytes of every parameter array of `model` (what its weights hold resident)."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def model_dtype(model) -> str:
    """The float dtype the model computes in: its embedding's (e.g. "bfloat16")."""
    from mlx.utils import tree_flatten

    for name, v in tree_flatten(model.parameters()):
        if name.endswith("embed_tokens.weight") and "float" in str(v.dtype):
            return str(v.dtype).rsplit(".", 1)[-1]
    floats = [v for _, v in tree_flatten(model.parameters()) if "float" in str(v.dtype)]
    return str(floats[0].dtype).rsplit(".", 1)[-1] if floats else "float32"


def _drop_mtp_classes(config: dict[str, Any]):
    """mlx-lm's classes, with `mtp.*` tensors removed before the model's own sanitize."""
    from mlx_lm.utils import _get_classes

    base_class, args_class = _get_classes(config)

    class ModelWithoutMTP(base_class):  # type: ignore[misc, valid-type]
        def sanitize(self, weights: dict) -> dict:
            weights = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
            parent = getattr(super(), "sanitize", None)
            return parent(weights) if parent else weights

    return lambda config: (ModelWithoutMTP, args_class)
