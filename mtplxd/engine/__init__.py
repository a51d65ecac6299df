"""The MLX engine: load a model, generate with exact MTP speculative decoding or plain AR.

Imports mlx, mlx-lm and numpy only (no trio, no HTTP), so it runs alone on any machine.
"""

# Every way into the engine (daemon, benchmarks, tests, scripts) passes here before the first
# `import mlx`: the BLAS MLX's CPU backend binds to must be loaded first (see mtplxd.blas).
from mtplxd import blas as _blas

_blas.activate()

from mtplxd.engine.interface import (
    CheckpointReport,
    GenerationRequest,
    GenerationResult,
    GenerationStats,
    ModelInfo,
    ModelLoadError,
    SamplingParams,
    TokenDelta,
)
from mtplxd.engine.loader import inspect_checkpoint
from mtplxd.engine.model import LoadedModel, load_model
from mtplxd.engine.owner import ModelOwner

__all__ = [
    "CheckpointReport",
    "GenerationRequest",
    "GenerationResult",
    "GenerationStats",
    "LoadedModel",
    "ModelInfo",
    "ModelLoadError",
    "ModelOwner",
    "SamplingParams",
    "TokenDelta",
    "inspect_checkpoint",
    "load_model",
]
