"""A quantized model on the CPU backend, its weights kept packed (`dequantize_weights="off"`;
where they fit, the Linux CPU dequantizes them by default: test_dequantize.py), decodes AR
unless a depth is asked for: MLX's CPU
quantized matmul costs every verify row a decode step, so MTP would only slow it down
(loader.default_depth). The head stays loaded: a request, or a configured depth, still gets
MTP; an unquantized model keeps its recommended depth."""

from __future__ import annotations

import pytest

from mtplxd.engine import GenerationRequest, SamplingParams, load_model
from mtplxd.engine.model.loader import DEFAULT_DEPTH, QUANTIZED_CPU_DEPTH_REASON, default_depth


def test_the_rule():
    assert default_depth({}, on_cuda=False, quantized_on_cpu=True) == (0, QUANTIZED_CPU_DEPTH_REASON)
    assert default_depth({}, on_cuda=False, quantized_on_cpu=False) == (DEFAULT_DEPTH, None)
    assert default_depth({"mtplx_default_depth": 5}, on_cuda=False, quantized_on_cpu=False) == (5, None)


@pytest.fixture(scope="module")
def quantized_path(tiny_model_factory):
    return tiny_model_factory("qwen3", quantize_bits=4, torch_dtype="bfloat16")


def test_a_quantized_model_on_the_cpu_is_served_ar_by_default_and_says_why(quantized_path):
    model = load_model(quantized_path, dequantize_weights="off")
    assert model.info.mode == "mtp" and model.head is not None
    assert model.info.depth == 0 and model.info.depth_reason == QUANTIZED_CPU_DEPTH_REASON
    prompt = model.tokenizer.encode("def add(a, b):")
    sampling = SamplingParams(max_tokens=12, ignore_eos=True)
    default = model.complete(GenerationRequest(prompt, sampling))
    assert default.stats.depth == 0 and default.stats.drafted == 0
    asked = model.complete(GenerationRequest(prompt, sampling, depth=2))  # a request still gets MTP
    assert asked.stats.depth == 2 and asked.stats.drafted > 0
    assert asked.token_ids == default.token_ids  # greedy MTP == AR


def test_a_configured_depth_wins_and_an_unquantized_model_keeps_its_own(quantized_path, tiny_model_factory):
    configured = load_model(quantized_path, depth=3, dequantize_weights="off")
    assert configured.info.depth == 3 and configured.info.depth_reason is None
    unquantized = load_model(tiny_model_factory("qwen3"))
    assert unquantized.info.depth == DEFAULT_DEPTH and unquantized.info.depth_reason is None


def test_a_tuned_depth_replaces_the_default_and_its_reason(quantized_path, tmp_path):
    """A real runtime with a depth `mtplxctl tune` saved for this model on this machine."""
    import trio

    from mtplxd.runtime import Runtime
    from mtplxd.tuning import save_tuned, tuning_key

    probe = load_model(quantized_path, dequantize_weights="off")
    save_tuned(tmp_path / "tuning", tuning_key(probe.info.to_dict()), {"depth": 2})
    seen = {}

    async def main() -> None:
        runtime = Runtime(tmp_path / "models", None, tuning_home=tmp_path / "tuning", dequantize="off")
        runtime.start()
        try:
            await runtime.load(str(quantized_path))
            seen.update(runtime.model.info.to_dict(), source=runtime.depth_source)
        finally:
            runtime.stop()

    trio.run(main)
    assert (seen["depth"], seen["depth_reason"], seen["source"]) == (2, None, "tuned")
