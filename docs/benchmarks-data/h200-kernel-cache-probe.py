"""Seconds to a 4B 4-bit model's first decoded tokens in a fresh process, for the kernel
cache check (docs/benchmarks.md): run it twice with the same MTPLX_HOME; the first run
compiles MLX's CUDA kernels into $MTPLX_HOME/cache/ptx, the second reads them back.

    MTPLX_HOME=/root/kc python3 docs/benchmarks-data/h200-kernel-cache-probe.py
"""
import json
import os
import time

started = time.perf_counter()
import mtplxd.engine  # noqa: F401  (sets MLX_PTX_CACHE_DIR before MLX compiles anything)
import mlx.core as mx

from mtplxd.engine.bench import real_size
from mtplxd.engine.bench.ar_reference import ours_decode_ms
from mtplxd.engine.model.trunk import Trunk

model, spec = real_size.build_model("qwen3-4b", "4bit")
built = time.perf_counter()
trunk = Trunk(model, spec)
prompt = mx.random.randint(0, trunk.text.args.vocab_size, (64,), key=mx.random.key(1)).tolist()
ms_first = ours_decode_ms(trunk, prompt, 4, 0.0)
first = time.perf_counter()
ms_warm = ours_decode_ms(trunk, prompt, 16, 0.0)
cache = os.environ.get("MLX_PTX_CACHE_DIR", "")
files = sum(len(f) for _, _, f in os.walk(cache)) if cache else 0
print(json.dumps({"mlx_ptx_cache_dir": cache, "cached_files_after": files,
                  "build_s": round(built - started, 2), "first_decode_s": round(first - built, 2),
                  "first_decode_ms_per_token": round(ms_first, 2), "warm_ms_per_token": round(ms_warm, 2)}))
