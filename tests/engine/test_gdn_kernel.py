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


# --- the verify with every row's state kept (verify_rows) --------------------------------

@pytest.fixture
def rows_forced():
    gdn_kernel.force_verify_rows(True)
    yield
    gdn_kernel.force_verify_rows(None)


def test_verify_rows_are_decode_steps_with_every_rows_state():
    """Row t of a verify is the decode step it stands for, bitwise, and its state is that of
    t+1 decode steps: off CUDA through the fallback the CPU tests drive, on CUDA through the
    every-row kernel against the decode kernel (they share their arithmetic, so MTP leaves AR
    only where matmuls do)."""
    q, k, v, a, b, A_log, dt_bias, state = gdn_kernel.probe_inputs(4)
    y, states = gdn_kernel.verify_rows(q, k, v, a, b, A_log, dt_bias, state)
    assert states.shape == (1, 4, *state.shape[1:]) and states.dtype == mx.float32
    step = state
    for t in range(4):
        want_y, step = gdn_kernel.decode_step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], a[:, t:t + 1],
                                              b[:, t:t + 1], A_log, dt_bias, step)
        assert mx.array_equal(y[:, t:t + 1], want_y).item() and mx.array_equal(states[:, t], step).item()


def test_off_cuda_a_verify_keeps_the_chunked_or_per_token_form():
    q, k, v, _, _, _, _, state = gdn_kernel.probe_inputs(4)
    if ON_CUDA:
        pytest.skip("on CUDA the every-row kernel runs")
    assert not gdn_kernel.verify_rows_wanted(q, k, v, state)
    assert gdn_kernel.verify_path_name() == "per-token"


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_a_trim_after_a_verify_on_rows_leaves_a_direct_forwards_state(tiny_model_factory, rows_forced, keep):
    """The stepwise loop's rollback (RollbackArraysCache.trim) picks the kept row's state:
    the same conv and recurrent state as a forward of only the kept rows (to float32
    rounding: an optimized BLAS rounds a row by the rows computed with it)."""
    from mtplxd.engine.model.rollback import RollbackArraysCache

    model = load_model(tiny_model_factory("qwen3_5", linear_key_head_dim=32, linear_value_head_dim=32))
    trunk, prompt, block = model.trunk, [5, 17, 42, 99, 3], [7, 8, 9, 10]
    verified, direct = trunk.make_cache(), trunk.make_cache()
    trunk.forward(mx.array([prompt]), verified, all_logits=False)
    trunk.forward(mx.array([prompt + block[:keep]]), direct, all_logits=False)
    trunk.forward(mx.array([block]), verified, all_logits=True)
    for ours, want in zip(verified, direct):
        if isinstance(ours, RollbackArraysCache):
            assert ours.capture.row_states is not None
            ours.trim(len(block) - keep)
            assert mx.allclose(ours[0], want[0], atol=1e-5).item() and mx.allclose(ours[1], want[1], atol=1e-5).item()


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_with_verify_rows_greedy_mtp_equals_ar_fused_and_stepwise(rows_forced, tmp_path, family):
    """What CUDA gets with the every-row kernel, on the CPU's arithmetic: the verify's rows are
    decode steps, both loops' rollbacks pick the kept row's state, and greedy MTP is AR's."""
    from mtplxd.engine.fixtures.tiny_hybrid import write_tiny_hybrid_checkpoint

    model = load_model(write_tiny_hybrid_checkpoint(tmp_path / family, family, draft_friendly=True))
    ids = model.tokenizer.encode("def add(a, b):\n    return")
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    ar = model.complete(GenerationRequest(ids, params, depth=0)).token_ids
    for loop in ("fused", "stepwise"):
        model.trunk.decode_loop = loop
        result = model.complete(GenerationRequest(ids, params, depth=3))
        assert result.token_ids == ar, loop
        assert result.stats.accepted > 0  # rollbacks of partial accepts happened too


@needs_cuda
def test_the_every_row_kernel_matches_mlx_lms_steps():
    assert gdn_kernel.rows_usable() and gdn_kernel.verify_path_name() == "CUDA kernel"
    assert gdn_kernel.rows_probe_error(4) < 1.0 and gdn_kernel.rows_probe_error(7) < 1.0
    q, k, v, a, b, A_log, dt_bias, state = gdn_kernel.probe_inputs(
        4, key_dim=128, value_dim=128, key_heads=16, value_heads=48, seed=5)
    assert gdn_kernel.verify_rows_wanted(q, k, v, state)
    y, states = gdn_kernel.verify_rows(q, k, v, a, b, A_log, dt_bias, state)
    step = state
    for t in range(4):
        want_y, step = gated_delta_update(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], a[:, t:t + 1],
                                          b[:, t:t + 1], A_log, dt_bias, step, None, use_kernel=False)
        assert mx.max(mx.abs(y[:, t:t + 1].astype(mx.float32) - want_y.astype(mx.float32))).item() < 0.05
        assert (mx.max(mx.abs(states[:, t] - step)) / mx.max(mx.abs(step))).item() < 1e-3


def test_only_a_verify_sized_forward_keeps_every_rows_state(rows_forced):
    """A short prompt (up to the capture limit, 32 rows) is captured too, but keeping its
    every row's state would cost 3 MB a row and layer at 27B size: past a verify's rows it
    keeps the chunked or per-token form."""
    def wanted(tokens: int) -> bool:
        q, k, v, *_, state = gdn_kernel.probe_inputs(tokens)
        return gdn_kernel.verify_rows_wanted(q, k, v, state)

    longest = gdn_kernel.MAX_VERIFY_ROWS
    assert [wanted(2), wanted(longest), wanted(longest + 1)] == [True, True, False]
