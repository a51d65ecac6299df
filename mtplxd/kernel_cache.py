"""Where MLX's CUDA backend keeps the kernels it compiles, chosen before MLX compiles any.

MLX's CUDA build compiles its kernels at run time with NVRTC, once per kernel variant, and
caches the result under `MLX_PTX_CACHE_DIR`, by default `/tmp/mlx/<version>/ptx`. /tmp is
emptied at every reboot (and between the device runs we measure on), so the first requests
after one pay the compilation again: on the H200, 14 s before a 4B bf16 model's first token
and 45 s at 4-bit, and 5-26 s more for each new decode-loop graph (docs/benchmarks.md,
"first-use compile time"). Under MTPLX_HOME the cache survives reboots.

The folder is keyed by MLX's version and the GPU's model name: a kernel compiled for one
architecture must never be loaded on another (a shared cache across GPU generations is a
known way to abort every request). A `MLX_PTX_CACHE_DIR` the user set is left alone. Off
CUDA (macOS's Metal, the CPU backend) nothing is set. This module imports neither MLX nor
trio; the GPU is read from the NVIDIA driver's /proc files, without starting a process.
"""

from __future__ import annotations

import os
import re
from importlib import metadata
from pathlib import Path

from mtplxd.paths import default_home

ENV = "MLX_PTX_CACHE_DIR"
NVIDIA_PROC = Path("/proc/driver/nvidia/gpus")


def gpu_model(proc_root: Path = NVIDIA_PROC) -> str | None:
    """The first NVIDIA GPU's model name as the driver reports it ("NVIDIA H200"), or None
    where there is no NVIDIA driver (every Mac, a CPU-only Linux)."""
    try:
        boards = sorted(proc_root.iterdir())
    except OSError:
        return None
    for board in boards:
        try:
            text = (board / "information").read_text(errors="replace")
        except OSError:
            continue
        match = re.search(r"^Model:\s*(.+)$", text, re.MULTILINE)
        if match:
            return match.group(1).strip()
    return None


def cache_dir(home: Path, model: str, mlx_version: str) -> Path:
    """The folder for one MLX version on one GPU model, with a file-name-safe model name."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", model).strip("-") or "gpu"
    return home / "cache" / "ptx" / mlx_version / safe


def activate(environ: dict[str, str] | None = None, *, home: Path | None = None,
             proc_root: Path = NVIDIA_PROC) -> Path | None:
    """Point MLX's kernel cache under MTPLX_HOME on an NVIDIA machine; return the folder
    used (None: off CUDA, set by the user, or the folder cannot be made: MLX's default)."""
    env = os.environ if environ is None else environ
    if env.get(ENV):
        return None
    model = gpu_model(proc_root)
    if model is None:
        return None
    try:
        version = metadata.version("mlx")
    except metadata.PackageNotFoundError:
        return None
    folder = cache_dir(home or default_home(), model, version)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # an unwritable home is reported where the daemon starts, not here
    env[ENV] = str(folder)
    return folder
