"""Recommended models by machine memory, and the pick `mtplxctl start` uses when none is named.

The entries are the MTPLX project's Qwen MTP packs (MLX-quantized, MTP head kept), published
under the `Youssofal` organisation on the Hugging Face Hub. Only the 4B pack's id is confirmed
by the reference notes (MTPLX's CI downloads `Youssofal/Qwen3.5-4B-MTPLX-Optimized-Speed`); the
others follow the same naming for packs the notes list (Qwen 3.5 9B, Qwen 3.6 27B) and are
marked `verified=False` until someone pulls them. `default_model_choice` checks the Hub before
picking one, so an id that does not exist falls back to the embedded model instead of failing.

Tiers are the memory of common Apple Silicon Macs: the model's weights plus a working KV cache
for agent-length contexts must leave the OS and the user's apps room (about half the RAM).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mtplxd.paths import Paths

EMBEDDED_ID = "mtplx-tiny-coder"
PROBE_TIMEOUT = 5.0


@dataclass(frozen=True)
class CatalogEntry:
    id: str                 # Hub repo id (or the embedded model's id)
    min_memory_gb: int      # smallest machine (GB of RAM) it is recommended for
    title: str
    download_gb: float      # approximate size of the weights
    quantization: str
    verified: bool          # the repo id was seen to exist (reference notes), not guessed
    note: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


CATALOG: tuple[CatalogEntry, ...] = (
    CatalogEntry("Youssofal/Qwen3.5-4B-MTPLX-Optimized-Speed", 16, "Qwen3.5 4B MTP", 3.3, "4bit",
                 True, "fast on any Apple Silicon Mac; the pack MTPLX's own CI serves"),
    CatalogEntry("Youssofal/Qwen3.5-9B-MTPLX-Optimized-Speed", 32, "Qwen3.5 9B MTP", 6.0, "4bit",
                 False, "MTPLX measured 1.6x on a 16 GB M4 Mac mini; roomier on 32 GB"),
    CatalogEntry("Youssofal/Qwen3.6-27B-MTPLX-Optimized-Speed", 64, "Qwen3.6 27B MTP", 16.0, "4bit",
                 False, "the flagship dense model; MTPLX measured 28 -> 63 tok/s on an M5 Max"),
    CatalogEntry("Youssofal/Qwen3.6-27B-MTPLX-Optimized-Quality", 128, "Qwen3.6 27B MTP (8-bit)", 29.0,
                 "8bit", False, "8-bit weights of the flagship: best quality, slower than 4-bit"),
)

EMBEDDED = CatalogEntry(EMBEDDED_ID, 0, "mtplx tiny coder (embedded demo)", 0.0, "none", True,
                        "ships with mtplx, works offline; a demo, not a coding model")


def machine_memory_gb() -> float:
    """This machine's RAM in GB (GiB, as Macs are sold: a 16 GB Mac reports 16.0)."""
    import psutil

    return psutil.virtual_memory().total / (1 << 30)


def recommended(memory_gb: float | None = None) -> CatalogEntry:
    """The largest catalog model recommended for `memory_gb` (default: this machine), else the embedded one."""
    memory = machine_memory_gb() if memory_gb is None else memory_gb
    fitting = [e for e in CATALOG if memory + 0.5 >= e.min_memory_gb]
    return max(fitting, key=lambda e: e.min_memory_gb) if fitting else EMBEDDED


def available_models(memory_gb: float | None = None) -> list[dict[str, Any]]:
    """The catalog for `models list --available`: each entry with `fits` and `recommended` flags."""
    memory = machine_memory_gb() if memory_gb is None else memory_gb
    pick = recommended(memory)
    rows = []
    for entry in (*CATALOG, EMBEDDED):
        rows.append({**entry.to_dict(), "fits": memory + 0.5 >= entry.min_memory_gb,
                     "recommended": entry.id == pick.id, "memory_gb": round(memory, 1)})
    return rows


def default_model_choice(paths: "Paths") -> str | None:
    """The catalog's pick for this machine when `mtplxctl start` is given no model, or None.

    Returns the recommended repo id when it is already pulled, or when the Hub is reachable and
    confirms the repo exists (the caller then pulls it). Returns None, meaning "serve the
    embedded model", when HF_HUB_OFFLINE is set, the Hub does not answer within a few seconds,
    the repo is not on the Hub, or the machine is too small for any catalog model.
    """
    from mtplxd.models.hub import hub_endpoint, hub_offline
    from mtplxd.models.store import resolve_pulled

    pick = recommended()
    if pick.id == EMBEDDED_ID:
        return None
    if resolve_pulled(pick.id, paths.models_dir) is not None:
        return pick.id
    if hub_offline():
        return None
    from huggingface_hub import HfApi

    try:
        HfApi(endpoint=hub_endpoint()).model_info(pick.id, timeout=PROBE_TIMEOUT)
    except Exception:  # offline, DNS, firewall, 404, gated: all mean "use the embedded model"
        return None
    return pick.id
