"""The Gated DeltaNet decode-step kernel (model/gdn_kernel.py): on CUDA it matches mlx-lm's
ops and the hybrid's AR step runs it; elsewhere mlx-lm's path runs, unchanged."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.gated_delta import gated_delta_update

from mtplxd.engine import GenerationRequest, SamplingParams, load_model
from mtplxd.engine.bench.host import primitives
from mtplxd.engine.model import gdn_kernel
from mtplxd.engine.model.kv_cache import fixed_shapes_wanted

ON_CUDA = fixed_shapes_wanted()
needs_cuda = pytest.mark.skipif(not ON_CUDA, reason="the kernel is CUDA only; this machine runs MLX on the CPU")


def test_off_cuda_the_step_is_mlx_lms_own():
    """The fallback: not usable, and decode_step gives mlx-lm's values bit for bit."""
    if ON_CUDA:
        pytest.skip("on CUDA the kernel runs")
    assert not gdn_kernel.usable() and gdn_kernel.path_name() in ("mlx-lm ops", "mlx-lm Metal kernel")
    q, k, v, a, b, A_log, dt_bias, state = gdn_kernel.probe_inputs(1)
    want = gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, None, use_kernel=True)
    got = gdn_kernel.decode_step(q, k, v, a, b, A_log, dt_bias, state)
    assert all(mx.array_equal(x, y).item() for x, y in zip(got, want))


def test_off_cuda_the_hybrids_ar_step_builds_mlx_lms_graph(tiny_model_factory):
    """No custom kernel in the hybrid's decode step off CUDA, and its tokens are the loop's."""
    if ON_CUDA:
        pytest.skip("on CUDA the kernel runs")
    model = load_model(tiny_model_factory("qwen3_5"))
    cache = model.trunk.make_cache()
    model.trunk.prefill(model.tokenizer.encode("def add(a, b):"), cache)
    _, logits = model.trunk.forward(mx.array([[5]]), cache, all_logits=True)
    assert "CustomKernel" not in primitives([logits]) and model.info.kernels["gdn_decode"] == "mlx-lm ops"


def test_the_kernels_domain():
    q, k, v, _, _, _, _, state = gdn_kernel.probe_inputs(1)
    assert gdn_kernel.supported(q, k, v, state)
    assert not gdn_kernel.supported(q, k, v, state.astype(mx.bfloat16))  # the state is float32
    assert not gdn_kernel.supported(q[..., :48], k[..., :48], v, state[..., :48])  # 32 lanes split the keys
    assert not gdn_kernel.supported(q, k, v[..., :30], state[:, :, :30])  # whole warps of value rows


@needs_cuda
@pytest.mark.parametrize("tokens", [1, 3])
def test_the_kernel_matches_mlx_lms_ops(tokens):
    assert gdn_kernel.usable()
    assert gdn_kernel.probe_error(tokens) < 1.0


@needs_cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_the_kernel_matches_at_the_27b_hybrids_shapes(dtype):
    """16 key heads, 48 value heads, 128 x 128 (Qwen3.5/3.6-27B's GDN layer), one token."""
    inputs = gdn_kernel.probe_inputs(1, key_dim=128, value_dim=128, key_heads=16, value_heads=48,
                                     dtype=dtype, seed=3)
    got_y, got_state = gdn_kernel.gated_delta_kernel(*inputs)
    assert got_y.dtype == dtype and got_state.dtype == mx.float32
    y_error, state_error = gdn_kernel.kernel_errors(inputs)
    assert y_error < 0.05 and state_error < 1e-3


@needs_cuda
def test_the_hybrids_ar_step_runs_the_kernel_and_decodes_as_before(tiny_model_factory):
    """The served AR step takes the kernel (one CustomKernel per GDN layer), and greedy tokens
    are those of mlx-lm's ops (the tiny hybrid's margins are far above the rounding)."""
    # The default tiny hybrid's key dimension (16) is outside the kernel's domain (32 lanes).
    model = load_model(tiny_model_factory("qwen3_5", linear_key_head_dim=32, linear_value_head_dim=32))
    assert model.info.kernels["gdn_decode"] == "CUDA kernel"
    ids = model.tokenizer.encode("def add(a, b):")
    cache = model.trunk.make_cache()
    model.trunk.prefill(ids, cache)
    _, logits = model.trunk.forward(mx.array([[5]]), cache, all_logits=True)
    gdn_layers = sum(1 for layer in model.trunk.text.model.layers if getattr(layer, "is_linear", False))
    assert primitives([logits]).get("CustomKernel", 0) >= gdn_layers
    request = GenerationRequest(ids, SamplingParams(max_tokens=24, ignore_eos=True), depth=0)
    with_kernel = model.complete(request).token_ids
    gdn_kernel._usable = False
    try:
        assert model.complete(request).token_ids == with_kernel
    finally:
        gdn_kernel._usable = None
