"""The Linux CPU computes in float32 (its BLAS path, and MLX's CPU quantized matmul in
float32 activations), quantized checkpoints included; Metal and CUDA keep the checkpoint's
dtype."""

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


@pytest.mark.parametrize("system, on_cpu, expected", [
    ("linux", True, "float32"),   # MLX's CPU backend: only float32 reaches the BLAS
    ("linux", False, None),       # CUDA computes bfloat16 natively
    ("darwin", False, None),      # Metal
    ("darwin", True, None),       # macOS keeps the checkpoint's dtype on Accelerate too
])
def test_compute_dtype_per_platform(system, on_cpu, expected):
    assert compute_dtype(system, on_cpu) == expected


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


@pytest.mark.parametrize("which", ["embedded", "quantized"])
def test_greedy_mtp_equals_ar_as_served(which, request):
    """The embedded model (bfloat16 upcast) and a 4-bit checkpoint (float32 scales and
    activations around its packed weights): MTP at depths 1 and 3 gives AR's tokens."""
    model = request.getfixturevalue(which)
    model = model[1] if which == "quantized" else model
    prompt = model.tokenizer.encode("def fibonacci(n):\n    ")

    def greedy(depth: int) -> list[int]:
        sampling = SamplingParams(max_tokens=48, ignore_eos=True)
        return model.complete(GenerationRequest(prompt_ids=prompt, depth=depth, sampling=sampling)).token_ids

    reference = greedy(0)
    for depth in (1, 3):
        assert greedy(depth) == reference, f"depth {depth} diverged"


@pytest.fixture(scope="module")
def quantized(tiny_model_factory):
    """A 4-bit checkpoint as mlx-community ships them: bfloat16 scales, biases and norms."""
    path = tiny_model_factory("qwen3", quantize_bits=4, torch_dtype="bfloat16")
    return path, load_model(path, dequantize_weights="off")  # packed (dequantized: test_dequantize.py)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the CPU upcast is Linux's")
def test_a_quantized_checkpoint_computes_in_float32_its_packed_weights_untouched(quantized):
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    path, model = quantized
    assert model.info.quantization and model.info.dtype == "float32"
    layers = [m for _, m in model.model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert layers and all(m["weight"].dtype == mx.uint32 and m["scales"].dtype == mx.float32
                          and m["biases"].dtype == mx.float32 for m in layers)
    floats = {v.dtype for _, v in tree_flatten(model.model.parameters()) if "float" in str(v.dtype)}
    assert floats == {mx.float32}
    # Resident: the file's packed weights as they are, its bfloat16 arrays twice as wide.
    files = list(path.glob("*.safetensors"))
    halves = sum(v.nbytes for file in files for v in mx.load(str(file)).values() if v.dtype == mx.bfloat16)
    assert halves and model.info.weights_bytes == sum(f.stat().st_size for f in files) + halves
    config = json.loads((path / "config.json").read_text())
    plan = plan_for_config(config, model.info.weights_bytes, model.info.dtype)
    assert plan.dtype_bytes == 4  # its KV cache is float32 too, and priced so


def test_compute_checkpoint_keeps_the_checkpoints_dtype_and_a_bad_choice_is_refused(quantized):
    from mtplxd.engine import ModelLoadError

    path, _ = quantized
    assert load_model(path, compute="checkpoint").info.dtype == "bfloat16"  # and packed: no float32
    assert "dequantized" not in load_model(path, compute="checkpoint").info.quantization
    with pytest.raises(ModelLoadError, match="compute must be one of auto, checkpoint"):
        load_model(path, compute="float64")
