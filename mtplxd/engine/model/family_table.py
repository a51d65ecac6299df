"""Every model family mlx-lm or mlx-vlm can load, and how mtplx serves it: MTP (with the
head's depth), AR (with the reason) or refused (with the reason). What
`mtplxctl models check --families` prints.

The lists come from the installed packages themselves: a module of `mlx_lm.models` that
defines `Model` is a family, as is a package of `mlx_vlm.models`; mlx-lm's remapped names
(`mistral` -> `llama`, ...) are listed as what they load as. Sources are read as text, not
imported, so listing ~250 families takes milliseconds and runs no model code.
"""

from __future__ import annotations

import importlib.util
import pkgutil
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mtplxd.engine.model.families import ar_reason, registered_families
from mtplxd.engine.model.loader import DEFAULT_DEPTH, MAX_DEPTH
from mtplxd.engine.model.vision import VISION_FAMILIES

# Levels the family's chat templates offer (the daemon reads them from the loaded template;
# a request for another level is a 400 that lists these).
QWEN_EFFORT = "none, minimal, low, medium, high, xhigh (thinking on/off)"
EFFORT_BY_FAMILY = {
    "qwen3": QWEN_EFFORT, "qwen3_5": QWEN_EFFORT, "qwen3_5_moe": QWEN_EFFORT,
    "qwen3_next": QWEN_EFFORT,
    "lfm2": "none (LFM2 instruct); high (LFM2.5 thinking checkpoints, which always reason)",
    "lfm2_moe": "none",
}
# Checkpoint-level refusals, whatever the family (`mtplxctl models check PATH` applies them).
CHECKPOINT_REFUSALS = (
    "config.json with auto_map (bundled Python code)",
    "quantization other than MLX affine 4-bit or 8-bit (GPTQ, AWQ, FP8, MXFP4, 2/3/5/6-bit)",
    "missing model*.safetensors, or an MTP head whose tensors do not match its config",
)


@dataclass
class FamilyRow:
    """One model type and how it is served."""

    model_type: str
    loaders: list[str]          # "mlx-lm", "mlx-vlm"
    mode: str                   # "mtp" | "ar" | "refused"
    reason: str | None          # why AR / why refused / what else applies
    mtp_head_layers: int        # the MTP head's depth in layers (0: none)
    draft_depth: str | None     # drafted tokens per cycle: "3 (0-8)"
    vision: bool                # images in the prompt are served
    reasoning_effort: str | None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        return asdict(self)


def _models_dir(package: str) -> Path | None:
    """`package`/models on disk, found without importing `package` (mlx-vlm's import pulls
    in transformers and takes seconds)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(list(spec.submodule_search_locations)[0]) / "models"
    return folder if folder.is_dir() else None


def mlx_lm_families() -> set[str]:
    """Model types mlx-lm has a `Model` class for."""
    folder = _models_dir("mlx_lm")
    if folder is None:
        return set()
    return {m.name for m in pkgutil.iter_modules([str(folder)]) if not m.ispkg and re.search(
        r"^class Model\(", (folder / f"{m.name}.py").read_text(errors="replace"), re.M)}


def mlx_vlm_families() -> set[str]:
    """Model types mlx-vlm has a package for (empty when mlx-vlm is not installed)."""
    folder = _models_dir("mlx_vlm")
    if folder is None:
        return set()
    return {m.name for m in pkgutil.iter_modules([str(folder)]) if m.ispkg}


def family_table() -> list[FamilyRow]:
    """Every loadable model type, sorted, with how mtplx serves it."""
    from mlx_lm.utils import MODEL_REMAPPING

    lm, vlm = mlx_lm_families(), mlx_vlm_families()
    mtp = set(registered_families())
    rows = []
    for model_type in sorted(lm | vlm | set(MODEL_REMAPPING)):
        loads_as = MODEL_REMAPPING.get(model_type, model_type)
        loaders = [n for n, have in (("mlx-lm", loads_as in lm), ("mlx-vlm", model_type in vlm)) if have]
        rows.append(_row(model_type, loads_as, loaders, loads_as in lm, loads_as in mtp))
    return rows


def _row(model_type: str, loads_as: str, loaders: list[str], text_loadable: bool,
         registered: bool) -> FamilyRow:
    vision = model_type in VISION_FAMILIES and "mlx-vlm" in loaders
    effort = EFFORT_BY_FAMILY.get(loads_as)
    alias = f"loaded as {loads_as!r}; " if loads_as != model_type else ""
    if not text_loadable:
        return FamilyRow(model_type, loaders, "refused",
                         "mlx-vlm only (a vision-language or special-purpose model without an "
                         "mlx-lm text trunk); mtplx decodes through mlx-lm's trunk",
                         0, None, False, None)
    if registered:
        note = ("AR instead when a checkpoint has no mtp.* tensors (most mlx-lm conversions "
                "drop them)")
        return FamilyRow(model_type, loaders, "mtp", alias + note, 1,
                         f"{DEFAULT_DEPTH} (0-{MAX_DEPTH})", vision, effort)
    return FamilyRow(model_type, loaders, "ar", alias + ar_reason(loads_as), 0, None, vision, effort)
