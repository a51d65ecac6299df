"""Recommended models by machine memory, and the pick `mtplxctl start` uses when none is named.

The entries are the MTPLX project's Qwen MTP packs (MLX-quantized, MTP head kept), published
under the `Youssofal` organisation on the Hugging Face Hub. Only the 4B pack's id is confirmed
by the reference notes (MTPLX's CI downloads `Youssofal/Qwen3.5-4B-MTPLX-Optimized-Speed`); the
others follow the same naming for packs the notes list (Qwen 3.5 9B, Qwen 3.6 27B) and are
marked `verified=False` until someone pulls them. `default_model_choice` checks the Hub before
picking one, so an id that does not exist falls back to the embedded model instead of failing.

What a machine is recommended depends on what MLX computes on there (`accelerator`):
- an Apple Silicon Mac (Metal): tiers are the memory of common Macs: the model's weights plus a
  working KV cache for agent-length contexts must leave the OS and the user's apps room (about
  half the RAM);
- NVIDIA with MLX's CUDA build: tiers are the GPU's own memory (`min_gpu_memory_gb`), nearly
  all of which the model may take;
- the CPU alone (Linux without a GPU build): no catalog model. MLX's CPU backend decodes a
  real model at seconds a token on a laptop-class CPU (docs/models.md quotes the figures), so
  `mtplxctl start` offers no multi-GB download there; the embedded model is the pick, and any
  model can still be pulled by name.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import asdict, dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from mtplxd.paths import Paths

EMBEDDED_ID = "mtplx-tiny-coder"
PROBE_TIMEOUT = 5.0


# Measured on a 2-vCPU Linux machine (docs/benchmarks.md, "Quantized checkpoints dequantized on
# the Linux CPU"): Qwen3-1.7B's dims at 4-bit, seconds a decoded token, dense and packed.
CPU_REASON = ("this machine computes on its CPU (no Metal, no MLX CUDA build): real models decode "
              "at seconds a token there (a 1.7B at 0.7-1.6 s on 2 cores), so none is recommended; "
              "pull one by name to try it anyway")


@dataclass(frozen=True)
class CatalogEntry:
    id: str                 # Hub repo id (or the embedded model's id)
    min_memory_gb: int      # smallest Mac (GB of unified memory) it is recommended for
    title: str
    download_gb: float      # approximate size of the weights
    quantization: str
    verified: bool          # the repo id was seen to exist (reference notes), not guessed
    note: str
    min_gpu_memory_gb: int = 0  # smallest NVIDIA GPU (GB of its memory) it is recommended for

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# GPU tiers: the weights plus a KV cache of agent-length contexts (about 3-8 GB at 64k tokens
# for these models) within the GPU's memory: 8, 12, 24 and 48 GB are common cards' sizes.
CATALOG: tuple[CatalogEntry, ...] = (
    CatalogEntry("Youssofal/Qwen3.5-4B-MTPLX-Optimized-Speed", 16, "Qwen3.5 4B MTP", 3.3, "4bit",
                 True, "fast on any Apple Silicon Mac; the pack MTPLX's own CI serves", 8),
    CatalogEntry("Youssofal/Qwen3.5-9B-MTPLX-Optimized-Speed", 32, "Qwen3.5 9B MTP", 6.0, "4bit",
                 False, "MTPLX measured 1.6x on a 16 GB M4 Mac mini; roomier on 32 GB", 12),
    CatalogEntry("Youssofal/Qwen3.6-27B-MTPLX-Optimized-Speed", 64, "Qwen3.6 27B MTP", 16.0, "4bit",
                 False, "the flagship dense model; MTPLX measured 28 -> 63 tok/s on an M5 Max", 24),
    CatalogEntry("Youssofal/Qwen3.6-27B-MTPLX-Optimized-Quality", 128, "Qwen3.6 27B MTP (8-bit)", 29.0,
                 "8bit", False, "8-bit weights of the flagship: best quality, slower than 4-bit", 48),
)

EMBEDDED = CatalogEntry(EMBEDDED_ID, 0, "mtplx tiny coder (embedded demo)", 0.0, "none", True,
                        "ships with mtplx, works offline; a demo, not a coding model")


def machine_memory_gb() -> float:
    """This machine's RAM in GB (GiB, as Macs are sold: a 16 GB Mac reports 16.0)."""
    import psutil

    return psutil.virtual_memory().total / (1 << 30)


def accelerator(distributions: Callable[[], Any] = metadata.distributions,
                gpu_model: Callable[[], str | None] | None = None, platform: str = sys.platform) -> str:
    """What MLX computes on here, read without importing MLX: "cuda" where MLX's CUDA build
    (the `mlx-cuda-*` package) is installed and the NVIDIA driver shows a GPU, "metal" on macOS,
    else "cpu" (Linux with MLX's CPU build, or a CUDA build without a GPU)."""
    if platform == "darwin":
        return "metal"
    names = {re.sub(r"[-_.]+", "-", (d.metadata["Name"] or "").lower()) for d in distributions()}
    if any(name.startswith("mlx-cuda") for name in names):
        from mtplxd import kernel_cache

        if (gpu_model or kernel_cache.gpu_model)() is not None:
            return "cuda"
    return "cpu"


def gpu_memory_gb(run: Callable[..., Any] = subprocess.run) -> float | None:
    """The first NVIDIA GPU's memory in GB (GiB), from nvidia-smi; None where it cannot say."""
    try:
        done = run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                   capture_output=True, text=True, timeout=10)
        return int(done.stdout.split()[0]) / 1024 if done.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def _tier(entry: CatalogEntry, on: str) -> int:
    """The memory (GB) `entry` asks of a machine computing `on` (an accelerator)."""
    return entry.min_gpu_memory_gb if on == "cuda" else entry.min_memory_gb


def _fits(entry: CatalogEntry, memory_gb: float, on: str) -> bool:
    """Whether `entry`'s tier fits `memory_gb` (half a GB of slack: a 16 GB machine may report
    15.6)."""
    return memory_gb + 0.5 >= _tier(entry, on)


def _machine(memory_gb: float | None, on: str | None) -> tuple[float, str]:
    """(memory in GB that the tiers read, accelerator): the GPU's memory on CUDA (the RAM where
    nvidia-smi cannot say), else the RAM."""
    on = accelerator() if on is None else on
    if memory_gb is None:
        memory_gb = (gpu_memory_gb() if on == "cuda" else None) or machine_memory_gb()
    return memory_gb, on


def recommended(memory_gb: float | None = None, on: str | None = None) -> CatalogEntry:
    """The largest catalog model recommended for a machine of `memory_gb` computing `on` (an
    accelerator; default: this machine's), else the embedded one (always on the CPU alone)."""
    memory, on = _machine(memory_gb, on)
    if on == "cpu":
        return EMBEDDED
    fitting = [e for e in CATALOG if _fits(e, memory, on)]
    return max(fitting, key=lambda e: _tier(e, on)) if fitting else EMBEDDED


def available_models(memory_gb: float | None = None, on: str | None = None) -> list[dict[str, Any]]:
    """The catalog for `models list --available`: each entry with `fits` (in the memory the
    tiers read: `memory_kind`), `recommended` and the memory it asks here (`tier_gb`); on the
    CPU alone, `cpu_reason` says why nothing but the embedded model is recommended."""
    memory, on = _machine(memory_gb, on)
    pick = recommended(memory, on)
    rows = []
    for entry in (*CATALOG, EMBEDDED):
        rows.append({**entry.to_dict(), "fits": _fits(entry, memory, on),
                     "recommended": entry.id == pick.id, "memory_gb": round(memory, 1),
                     "tier_gb": _tier(entry, on), "accelerator": on,
                     "memory_kind": "GPU memory" if on == "cuda" else "RAM",
                     "cpu_reason": CPU_REASON if on == "cpu" else None})
    return rows


def default_model_choice(paths: "Paths", pick: CatalogEntry | None = None) -> str | None:
    """The catalog's pick for this machine when `mtplxctl start` is given no model, or None
    (`pick`: `recommended()`'s answer where the caller has it already).

    Returns the recommended repo id when it is already pulled, or when the Hub is reachable and
    confirms the repo exists (the caller then pulls it). Returns None, meaning "serve the
    embedded model", when HF_HUB_OFFLINE is set, the Hub does not answer within a few seconds,
    the repo is not on the Hub, or the machine is too small for any catalog model.
    """
    from mtplxd.models.hub import hub_endpoint, hub_offline
    from mtplxd.models.store import resolve_pulled

    pick = recommended() if pick is None else pick
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
