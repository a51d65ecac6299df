"""The query and key norms and rope in one kernel (model/qk_norm_rope.py): the swapped
attention layers compute mlx-lm's outputs wherever MLX's ops run (this machine: bit for bit,
greedy MTP still equal to AR), only plain-rope qwen3 layers are swapped, and on CUDA the
kernel matches MLX's ops at every shape a served model gives it."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import qwen3, qwen3_next

from mtplxd.engine import GenerationRequest, SamplingParams, load_model
from mtplxd.engine.model import qk_norm_rope
from mtplxd.engine.model.kv_cache import fixed_shapes_wanted
from support.numerics import assert_computes_as

ON_CUDA = fixed_shapes_wanted()
needs_cuda = pytest.mark.skipif(not ON_CUDA, reason="the kernel is CUDA only; this machine runs MLX on the CPU")


def _swapped(model: nn.Module) -> int:
    return sum(type(m) is qk_norm_rope.NormRopeAttention for _, m in model.named_modules())


def test_off_cuda_nothing_is_swapped_and_status_names_mlxs_ops(tiny_model_factory, monkeypatch):
    if ON_CUDA:
        pytest.skip("on CUDA the kernel runs")
    monkeypatch.setenv(qk_norm_rope.ENV, "1")
    loaded = load_model(tiny_model_factory("qwen3", head_dim=64), compute="checkpoint")
    assert not qk_norm_rope.usable() and qk_norm_rope.install(loaded.model, force=True) == 0
    assert _swapped(loaded.model) == 0
    assert loaded.info.kernels["qk_norm_rope"] == "MLX's rms_norm and rope"


def test_swapped_layers_compute_mlx_lms_logits_and_greedy_mtp_equals_ar(tiny_model_factory, monkeypatch):
    """Every layer swapped (trunk and MTP head), then run where the kernel is not usable:
    NormRopeAttention's forward with MLX's ops is mlx-lm's, to the bit."""
    if ON_CUDA:
        pytest.skip("on CUDA the swapped layers run the kernel (the CUDA tests below)")
    path = tiny_model_factory("qwen3", head_dim=64, torch_dtype="bfloat16")
    stock = load_model(path, compute="checkpoint")
    swapped = load_model(path, compute="checkpoint")
    with monkeypatch.context() as patch:
        patch.setattr(qk_norm_rope, "usable", lambda: True)  # a GPU's answer, for the swap only
        count = qk_norm_rope.install(swapped.model, force=True)
    layers = len(swapped.trunk.text.layers)
    assert count == _swapped(swapped.model) == layers + 1  # the MTP head's layer too
    assert _swapped(stock.model) == 0
    assert_computes_as(swapped, stock, swapped.tokenizer.encode("def add(a, b):"))


def test_a_cohorts_batched_forward_with_swapped_layers_gives_each_row_its_numbers(tiny_model_factory, monkeypatch):
    """The cohort's batched forward runs a swapped layer's norms and rope row by row (as the
    row's solo forward does): ragged rows and a padding row, the same logits and caches as
    mlx-lm's layers where MLX's ops run."""
    if ON_CUDA:
        pytest.skip("on CUDA the swapped layers run the kernel")
    from mtplxd.engine.model.batched import batched_forward

    path = tiny_model_factory("qwen3", head_dim=64, torch_dtype="bfloat16")
    stock, swapped = (load_model(path, compute="checkpoint") for _ in range(2))
    with monkeypatch.context() as patch:
        patch.setattr(qk_norm_rope, "usable", lambda: True)
        assert qk_norm_rope.install(swapped.model, force=True) > 0
    tokens = mx.array([swapped.tokenizer.encode("def add(a, b):")[:5]] * 3)
    results = []
    for model in (stock, swapped):
        caches = [model.trunk.make_cache(), None, model.trunk.make_cache()]
        _, logits = batched_forward(model.trunk, tokens, caches, lengths=[5, 5, 3])
        results.append((logits[0], logits[2, :3], [c.offset for c in caches[2]]))
    assert mx.array_equal(results[0][0], results[1][0]).item()
    assert mx.array_equal(results[0][1], results[1][1]).item()
    assert results[0][2] == results[1][2]


def _args(**change) -> qwen3.ModelArgs:
    values = dict(model_type="qwen3", hidden_size=256, num_hidden_layers=1, intermediate_size=64,
                  num_attention_heads=4, rms_norm_eps=1e-6, vocab_size=32, num_key_value_heads=2,
                  max_position_embeddings=4096, head_dim=64, tie_word_embeddings=True, rope_theta=10000.0)
    values.update(change)
    return qwen3.ModelArgs(**values)


def test_only_plain_rope_qwen3_layers_are_installable():
    assert qk_norm_rope.installable(qwen3.Attention(_args()))
    assert qk_norm_rope.installable(qwen3.Attention(_args(head_dim=16)))  # half a warp of pairs
    assert not qk_norm_rope.installable(qwen3.Attention(_args(head_dim=1024)))  # over MAX_HEAD_DIM
    scaled = qwen3.Attention(_args(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}))
    assert type(scaled.rope) is not nn.RoPE and not qk_norm_rope.installable(scaled)
    traditional = qwen3.Attention(_args())
    traditional.rope = nn.RoPE(64, traditional=True, base=10000.0)
    assert not qk_norm_rope.installable(traditional)
    partial = qwen3.Attention(_args())
    partial.rope = nn.RoPE(32, base=10000.0)  # rotating part of the head
    assert not qk_norm_rope.installable(partial)
    uneven = qwen3.Attention(_args())
    uneven.k_norm.eps = 1e-5
    assert not qk_norm_rope.installable(uneven)
    next_args = qwen3_next.ModelArgs.from_dict({
        "model_type": "qwen3_next", "hidden_size": 256, "num_hidden_layers": 4, "intermediate_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "rms_norm_eps": 1e-6,
        "vocab_size": 32, "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "max_position_embeddings": 4096,
        "linear_num_value_heads": 2, "linear_num_key_heads": 2, "linear_key_head_dim": 32,
        "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "num_experts": 0, "num_experts_per_tok": 0,
        "decoder_sparse_step": 1, "shared_expert_intermediate_size": 0, "moe_intermediate_size": 0,
        "mlp_only_layers": [], "full_attention_interval": 4, "tie_word_embeddings": True})
    assert not qk_norm_rope.installable(qwen3_next.Qwen3NextAttention(next_args))


@pytest.mark.parametrize("offset", [7, mx.array(7, dtype=mx.int32), mx.array([7, 30], dtype=mx.int32)])
def test_the_reference_is_mlx_lms_sequence_at_every_kind_of_offset(offset):
    """An int, a scalar array or one offset a batch row (a cohort's RowsKVCache): each row's
    heads normed, transposed to (B, H, L, D) and rotated from its own offset."""
    attention = qk_norm_rope.probe_attention(head_dim=64)
    queries = mx.random.normal((2, 3, 4 * 64), key=mx.random.key(1))
    keys = mx.random.normal((2, 3, 2 * 64), key=mx.random.key(2))
    q, k = qk_norm_rope.reference(attention, queries, keys, offset)
    assert q.shape == (2, 4, 3, 64) and k.shape == (2, 2, 3, 64)
    starts = [7, 30] if isinstance(offset, mx.array) and offset.size == 2 else [7, 7]
    for row, start in enumerate(starts):
        want = attention.rope(attention.k_norm(keys[row:row + 1].reshape(1, 3, 2, 64)).transpose(0, 2, 1, 3),
                              offset=start)
        assert mx.array_equal(k[row:row + 1], want).item()
    assert qk_norm_rope.supported(attention, queries, offset)
    assert not qk_norm_rope.supported(attention, queries, mx.array([1, 2, 3], dtype=mx.int32))
    assert not qk_norm_rope.supported(attention, queries.astype(mx.int32), offset)


def test_float_bits_round_trip_through_float32():
    import struct

    for value in (1e-6, 13.287712379549449, 1.0):
        bits = qk_norm_rope._float_bits(value)
        assert -2**31 <= bits < 2**31
        assert struct.unpack("<f", struct.pack("<i", bits))[0] == pytest.approx(value, rel=1e-7)


def test_path_names():
    assert qk_norm_rope.path_name(0) == "MLX's rms_norm and rope"
    assert qk_norm_rope.path_name(37) == "one kernel a layer (37 layers, MTPLX_QK_NORM_ROPE=1)"


@needs_cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
@pytest.mark.parametrize("batch,tokens,offset", [
    (1, 1, mx.array(517, dtype=mx.int32)),  # a decode step over a StaticKVCache
    (1, 6, mx.array(4000, dtype=mx.int32)),  # a depth-5 verify
    (1, 37, 0),  # a prompt chunk over mlx-lm's KVCache (an int offset)
    (3, 4, mx.array([5, 900, 61], dtype=mx.int32)),  # a cohort's rows, each at its offset
])
def test_cuda_kernel_matches_mlxs_ops_at_a_4b_layers_shape(dtype, batch, tokens, offset):
    assert qk_norm_rope.usable()
    attention = qk_norm_rope.probe_attention(head_dim=128, heads=32, kv_heads=8)
    assert qk_norm_rope.kernel_error(attention, batch, tokens, offset, dtype) < 1.0


@needs_cuda
@pytest.mark.parametrize("head_dim", [16, 64, 256])
def test_cuda_kernel_matches_mlxs_ops_at_other_head_widths(head_dim):
    """Half a warp of pairs (the tiny fixtures' heads), two warps, four."""
    attention = qk_norm_rope.probe_attention(head_dim=head_dim, heads=6, kv_heads=2)
    assert qk_norm_rope.kernel_error(attention, 1, 4, mx.array(77, dtype=mx.int32)) < 1.0


@needs_cuda
def test_cuda_greedy_mtp_equals_ar_with_the_kernel(tiny_model_factory, monkeypatch):
    monkeypatch.setenv(qk_norm_rope.ENV, "1")
    loaded = load_model(tiny_model_factory("qwen3", head_dim=64, torch_dtype="bfloat16"), compute="checkpoint")
    assert _swapped(loaded.model) == len(loaded.trunk.text.layers) + 1
    assert loaded.info.kernels["qk_norm_rope"].startswith("one kernel a layer")
    ids = loaded.tokenizer.encode("def add(a, b):")

    def run(depth):
        request = GenerationRequest(ids, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), depth=depth)
        return loaded.complete(request).token_ids

    assert run(0) == run(3)
