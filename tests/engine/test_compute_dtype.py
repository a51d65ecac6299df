"""The Linux CPU computes in float32 (its BLAS path); Metal and CUDA keep the checkpoint's dtype."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import mtplxd
from mtplxd.engine import GenerationRequest, SamplingParams, load_model
from mtplxd.engine.model.loader import compute_dtype
from mtplxd.guard import plan_for_config

EMBEDDED_DIR = Path(mtplxd.__file__).parent / "models" / "embedded"


@pytest.mark.parametrize("system, on_cpu, quantized, expected", [
    ("linux", True, False, "float32"),   # MLX's CPU backend: only float32 reaches the BLAS
    ("linux", False, False, None),       # CUDA computes bfloat16 natively
    ("linux", True, True, None),         # quantized weights keep their own kernels
    ("darwin", False, False, None),      # Metal
    ("darwin", True, False, None),       # macOS keeps the checkpoint's dtype on Accelerate too
])
def test_compute_dtype_per_platform(system, on_cpu, quantized, expected):
    assert compute_dtype(system, on_cpu, quantized) == expected


def test_guard_prices_the_dtype_the_model_computes_in():
    config = json.loads((EMBEDDED_DIR / "config.json").read_text())
    bf16 = plan_for_config(config, 1000)
    f32 = plan_for_config(config, 2000, "float32")
    assert (bf16.dtype_bytes, f32.dtype_bytes) == (2, 4)
    assert f32.kv_bytes_per_token == 2 * bf16.kv_bytes_per_token


@pytest.fixture(scope="module")
def embedded():
    return load_model(EMBEDDED_DIR, model_id="mtplx-tiny-coder")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the CPU upcast is Linux's")
def test_bfloat16_checkpoint_is_upcast_and_priced_as_resident(embedded):
    file_bytes = sum(f.stat().st_size for f in EMBEDDED_DIR.glob("*.safetensors"))
    assert embedded.info.dtype == "float32"
    # Every bfloat16 weight doubled: about twice the file (its header and int tensors aside).
    assert 1.9 * file_bytes < embedded.info.weights_bytes < 2.05 * file_bytes


def test_greedy_mtp_equals_ar_on_the_embedded_model_as_served(embedded):
    prompt = embedded.tokenizer.encode("def fibonacci(n):\n    ")

    def greedy(depth: int) -> list[int]:
        request = GenerationRequest(prompt_ids=prompt, depth=depth,
                                    sampling=SamplingParams(max_tokens=48, ignore_eos=True))
        return embedded.complete(request).token_ids

    reference = greedy(0)
    for depth in (1, 3):
        assert greedy(depth) == reference, f"depth {depth} diverged"
