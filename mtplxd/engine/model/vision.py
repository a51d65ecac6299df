"""Images in the prompt: the checkpoint's own vision tower and image processor, from mlx-vlm.

mlx-vlm builds the tower (`VisionModel` of the checkpoint's family) and preprocesses pixels
(its torch-free numpy port of the Qwen-VL image processor); the trunk, the MTP drafting after
the image and the exactness contract stay ours. An image becomes `n` rows of the trunk's
input embeddings at the positions of its `<|image_pad|>` placeholders (the chat template
writes one, `expand_placeholders` widens it to `n`), so the speculative and AR paths prefill
the same embeddings and greedy MTP still equals greedy AR.

Positions: image rows sit at Qwen-VL's multimodal (t, h, w) rotary positions and the text
after an image continues from the largest one (mrope.py: mlx-vlm's own position computation,
applied by the trunk's attention layers and the MTP head's), so the trunk sees a prompt where
mlx-vlm's own model puts it.

`prepare` is tokenizer-side work (PIL and numpy, no MLX) and may run in any thread;
`embed_prompt` runs the tower on the model-owner thread.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mtplxd.engine.interface import ModelLoadError, PreparedImage

if TYPE_CHECKING:
    from mtplxd.engine.model.mrope import PromptPositions, RowPositions

# model_type -> the mlx-vlm package whose VisionModel and config serve it.
VISION_FAMILIES = {"qwen3_5": "qwen3_5", "qwen3_5_moe": "qwen3_5_moe"}
# Image bytes a request may carry, each (decoded pixels are capped by the processor).
MAX_IMAGE_BYTES = 20 * 1024 * 1024
# Decoded pixels of one image before the processor shrinks it: a small compressed file may
# expand to gigabytes (a "decompression bomb"), so its size is checked before decoding.
MAX_IMAGE_PIXELS = 64 * 1024 * 1024


class ImageError(ValueError):
    """An image that cannot be read; the message says why (a 400 at the API)."""


def has_vision_config(config: dict[str, Any]) -> bool:
    """True when config.json describes a vision tower."""
    return isinstance(config.get("vision_config"), dict)


def vision_refusal(config: dict[str, Any]) -> str | None:
    """Why a checkpoint's vision tower cannot be served (its text is served anyway), or None."""
    if not has_vision_config(config):
        return None
    model_type = config.get("model_type")
    if model_type not in VISION_FAMILIES:
        return (f"images are served for the Qwen vision families ({', '.join(VISION_FAMILIES)}); "
                f"{model_type!r} is served text-only")
    try:
        import mlx_vlm  # noqa: F401
    except ImportError:
        return "mlx-vlm is not installed (pip install 'mtplx[vision]'); serving text only"
    return None


@dataclass
class VisionTower:
    """A loaded vision tower and its image processor."""

    model: Any            # mlx-vlm VisionModel
    processor: Any        # mlx-vlm Qwen3VLImageProcessor
    image_token_id: int
    merge_size: int
    positions: PromptPositions | None = None  # the checkpoint's mRoPE rule (mrope.py)

    def prepare(self, data: bytes) -> PreparedImage:
        """Decode and preprocess one image (any thread; no MLX). Raises ImageError."""
        from PIL import Image, UnidentifiedImageError

        if len(data) > MAX_IMAGE_BYTES:
            raise ImageError(f"the image is {len(data)} bytes; at most {MAX_IMAGE_BYTES} are accepted")
        try:
            with Image.open(io.BytesIO(data)) as image:
                width, height = image.size
                if width * height > MAX_IMAGE_PIXELS:
                    raise ImageError(f"the image is {width}x{height} pixels; at most "
                                     f"{MAX_IMAGE_PIXELS} pixels are decoded")
                rgb = image.convert("RGB")
        except (UnidentifiedImageError, OSError, ValueError) as exc:
            raise ImageError(f"the image could not be decoded ({exc}); send PNG, JPEG, GIF or WebP") from None
        out = self.processor([rgb])
        grid = tuple(int(v) for v in out["image_grid_thw"][0])
        tokens = grid[0] * grid[1] * grid[2] // (self.merge_size ** 2)
        pixels = out["pixel_values"]
        return PreparedImage(digest=hashlib.sha256(data).hexdigest(), tokens=tokens,
                             grid_thw=grid, pixel_values=pixels,
                             price_bytes=self.price(pixels.shape[0], pixels.nbytes, tokens))

    def price(self, patches: int, pixel_bytes: int, tokens: int) -> int:
        """Peak bytes of one image in the tower (float32 upper bound): its pixels, a block's
        activations (hidden and MLP rows), one head's attention scores at a time for every
        head, and the output rows."""
        config = self.model.config if hasattr(self.model, "config") else None
        hidden = int(getattr(config, "hidden_size", 1024))
        inner = int(getattr(config, "intermediate_size", 4 * hidden))
        heads = int(getattr(config, "num_heads", 16))
        out_hidden = int(getattr(config, "out_hidden_size", hidden))
        activations = patches * (3 * hidden + inner) * 4
        scores = patches * patches * heads * 4
        return pixel_bytes + activations + scores + tokens * out_hidden * 4

    def features(self, image: PreparedImage) -> Any:
        """The tower's output for one image: (tokens, hidden) (owner thread)."""
        import mlx.core as mx

        dtype = self.model.patch_embed.proj.weight.dtype
        pixels = mx.array(image.pixel_values).astype(dtype)
        hidden, _ = self.model(pixels, mx.array([list(image.grid_thw)]))
        return hidden

    def embed_prompt(self, embed_tokens: Any, prompt_ids: list[int],
                     images: list[PreparedImage]) -> Any:
        """(1, L, H) input embeddings: the tokens' own, with each image's placeholder run
        replaced by its features, in order (owner thread)."""
        import mlx.core as mx

        ids = np.asarray(prompt_ids)
        runs = placeholder_runs(prompt_ids, self.image_token_id)
        if [n for _, n in runs] != [image.tokens for image in images]:
            raise ImageError("the prompt's image placeholders do not match its images")
        pieces, last = [], 0
        base = embed_tokens(mx.array(ids)[None])[0]
        for (start, count), image in zip(runs, images):
            pieces += [base[last:start], self.features(image).astype(base.dtype)]
            last = start + count
        pieces.append(base[last:])
        return mx.concatenate(pieces, axis=0)[None]

    def row_positions(self, prompt_ids: list[int], images: list[PreparedImage]) -> RowPositions | None:
        """Where each token of this prompt sits (mRoPE), or None for a tower without a
        position rule."""
        if self.positions is None:
            return None
        return self.positions.for_prompt(prompt_ids, [image.grid_thw for image in images],
                                         placeholder_runs(prompt_ids, self.image_token_id))


def placeholder_runs(prompt_ids: list[int], token_id: int) -> list[tuple[int, int]]:
    """(start, length) of every maximal run of `token_id` in the prompt."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, token in enumerate(list(prompt_ids) + [None]):
        if token == token_id and start is None:
            start = i
        elif token != token_id and start is not None:
            runs.append((start, i - start))
            start = None
    return runs


def expand_placeholders(prompt_ids: list[int], token_id: int, images: list[PreparedImage]) -> list[int]:
    """Widen the template's one placeholder per image to the image's token count."""
    positions = [i for i, t in enumerate(prompt_ids) if t == token_id]
    if len(positions) != len(images):
        raise ImageError(f"the chat template wrote {len(positions)} image placeholders for "
                         f"{len(images)} images")
    out: list[int] = []
    last = 0
    for position, image in zip(positions, images):
        out += prompt_ids[last:position] + [token_id] * image.tokens
        last = position + 1
    return out + prompt_ids[last:]


def bank_key(prompt_ids: list[int], token_id: int, images: list[PreparedImage]) -> list[int]:
    """The prompt as the session bank keys it: each image row is a value derived from the
    image's bytes and the row's index (negative, so never a real token id), so a prefix
    matches across an image only when the image bytes are the same."""
    key = list(prompt_ids)
    for (start, count), image in zip(placeholder_runs(prompt_ids, token_id), images):
        seed = bytes.fromhex(image.digest)
        for row in range(count):
            digest = hashlib.sha256(seed + row.to_bytes(4, "little")).digest()
            key[start + row] = -1 - (int.from_bytes(digest[:4], "little") & 0x7FFFFFFE)
    return key


def load_vision_tower(path: Path, config: dict[str, Any]) -> VisionTower:
    """Build the tower from mlx-vlm and load its weights (`model.visual.*` or `vision_tower.*`)
    strictly from the checkpoint. Raises ModelLoadError."""
    import importlib

    import mlx.core as mx

    family = VISION_FAMILIES[config["model_type"]]
    config_module = importlib.import_module(f"mlx_vlm.models.{family}.config")
    vision_module = importlib.import_module(f"mlx_vlm.models.{family}.vision")
    from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import Qwen3VLImageProcessor

    vision_config = config_module.VisionConfig.from_dict(config["vision_config"])
    model = vision_module.VisionModel(vision_config)
    weights: dict[str, Any] = {}
    for file in sorted(path.glob("model*.safetensors")):  # the shards mlx-lm loads
        for name, value in mx.load(str(file)).items():
            for prefix in ("model.visual.", "vision_tower.", "model.language_model.visual."):
                if name.startswith(prefix):
                    weights[name[len(prefix):]] = value
    if not weights:
        raise ModelLoadError(f"{path.name}: config.json has vision_config but the weights hold no "
                             "vision tower (model.visual.*)")
    _quantize_like(model, weights, config)
    try:
        model.load_weights(list(model.sanitize(weights).items()), strict=True)
    except ValueError as exc:
        raise ModelLoadError(f"{path.name}: the vision tower's weights do not match its config: {exc}") from None
    mx.eval(model.parameters())
    processor = Qwen3VLImageProcessor(**processor_kwargs(path, vision_config.patch_size))
    token = config.get("image_token_id") or config.get("image_token_index")
    if not isinstance(token, int):
        raise ModelLoadError(f"{path.name}: config.json names no image_token_id")
    from mtplxd.engine.model.mrope import PromptPositions

    try:
        positions = PromptPositions(family, config)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{path.name}: mlx-vlm cannot read the text config's rotary "
                             f"positions: {exc}") from None
    return VisionTower(model=model, processor=processor, image_token_id=token,
                       merge_size=int(getattr(processor, "merge_size", vision_config.spatial_merge_size)),
                       positions=positions)


def _quantize_like(model: Any, weights: dict[str, Any], config: dict[str, Any]) -> None:
    """Quantize the tower's layers that the checkpoint stores quantized (an mlx-vlm
    conversion with a quantized tower carries `.scales` beside their weights)."""
    if not any(name.endswith(".scales") for name in weights):
        return
    import mlx.nn as nn

    quant = config.get("quantization") or {}
    nn.quantize(model, group_size=int(quant.get("group_size", 64)), bits=int(quant.get("bits", 4)),
                class_predicate=lambda path, module: f"{path}.scales" in weights)


_PROCESSOR_KEYS = ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std",
                   "rescale_factor", "do_rescale", "do_normalize", "do_convert_rgb",
                   "min_pixels", "max_pixels")


def processor_kwargs(path: Path, patch_size: int) -> dict[str, Any]:
    """The image processor's settings from the checkpoint's preprocessor_config.json (and
    processor_config.json's `image_processor`), read from disk only (mlx-vlm's own reader
    falls back to the Hub)."""
    raw: dict[str, Any] = {}
    for name in ("preprocessor_config.json", "processor_config.json"):
        file = path / name
        if file.is_file():
            data = json.loads(file.read_text())
            raw.update(data.get("image_processor", data) if name == "processor_config.json" else data)
    out: dict[str, Any] = {"patch_size": patch_size}
    out.update({k: raw[k] for k in _PROCESSOR_KEYS if raw.get(k) is not None})
    size = raw.get("size") or {}
    if size.get("shortest_edge") is not None:
        out.setdefault("min_pixels", size["shortest_edge"])
    if size.get("longest_edge") is not None:
        out.setdefault("max_pixels", size["longest_edge"])
    return out
