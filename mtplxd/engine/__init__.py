"""The MLX engine: load a model, generate with exact MTP speculative decoding or plain AR.

Imports mlx, mlx-lm and numpy only (no trio, no HTTP, nothing else of mtplxd but `mtplxd.blas`,
which picks the CPU's BLAS before MLX loads, `mtplxd.kernel_cache`, which keeps CUDA's
compiled kernels under MTPLX_HOME, `mtplxd.matmul_precision`, which keeps float32 matmuls
out of TF32, and `mtplxd.fd_limits`, which keeps mlx-lm from lowering the open-file limit),
so it runs alone on any machine. Its rooms, each importing only the ones below it:

- `interface`: the types every room shares (requests, results, stats, model info).
- `model/`: loader, families, trunk, MTP head, hybrid layers, KV and rollback caches.
- `decoding/`: the speculative, fused and AR loops, sampling, detokenizing.
- `session/`: the session bank (RAM and SSD tiers).
- `loaded_model`, `generation`, `scheduler`, `owner` (this level): the runtime that ties them
  together; the scheduler steps every generation a prefill chunk or decode cycle at a time.
- `distributed/`: one model served over several processes or hosts (pipeline parallel over
  `mx.distributed`), rank 0's trunk and the workers' loop; see docs/distributed.md.
- `fixtures/` and `bench/`: tiny checkpoints and benchmarks; the runtime never imports them.
"""

# Every way into the engine (daemon, benchmarks, tests, scripts) passes here before the first
# `import mlx`: the BLAS MLX's CPU backend binds to must be loaded first (see mtplxd.blas), on
# CUDA its compiled kernels must be kept where a reboot does not wipe them (kernel_cache),
# float32 matmuls must stay float32 rather than TF32 (matmul_precision), and mlx-lm must not
# lower the open-file limit as it is imported (fd_limits).
from mtplxd import blas as _blas
from mtplxd import fd_limits as _fd_limits
from mtplxd import kernel_cache as _kernel_cache
from mtplxd import matmul_precision as _matmul_precision

_blas.activate()
_kernel_cache.activate()
_matmul_precision.activate()
_fd_limits.activate()  # mlx-lm's import would lower the open-file limit, or fail under 4096

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
from mtplxd.engine.loaded_model import LoadedModel, load_model
from mtplxd.engine.model.loader import inspect_checkpoint
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
