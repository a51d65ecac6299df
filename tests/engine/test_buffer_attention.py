"""buffer_attention.py (the CUDA kernel for attention over a cache buffer) and its routing.

The kernel needs MLX's CUDA backend: those tests skip elsewhere and were run on the H200
(docs/benchmarks.md says when). On other backends the routing must leave mlx-lm's masked
attention in place, which the CPU tests here and the fused loop's exactness gates check.
"""

import math
import shutil
import subprocess

import mlx.core as mx
import mlx_lm.models.qwen3 as mlx_lm_qwen3
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from mtplxd.engine import GenerationRequest, SamplingParams, load_model
from mtplxd.engine.decoding import buffer_attention, fused
from mtplxd.engine.model import custom_kernels
from mtplxd.engine.model.kv_cache import fixed_shapes_wanted
from tests.support import cuda_emulator

needs_cuda = pytest.mark.skipif(not fixed_shapes_wanted(), reason="the kernel needs MLX's CUDA backend")


def attention_inputs(heads, kv_heads, rows, dim, slots, seed=0):
    keys = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((1, heads, rows, dim), key=keys[0]).astype(mx.bfloat16)
    k = mx.random.normal((1, kv_heads, slots, dim), key=keys[1]).astype(mx.bfloat16)
    v = mx.random.normal((1, kv_heads, slots, dim), key=keys[2]).astype(mx.bfloat16)
    return q, k, v


def masked_attention(q, k, v, offset, scale):
    rows, slots = q.shape[2], k.shape[2]
    mask = mx.arange(slots)[None] <= offset + mx.arange(rows)[:, None]
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def test_the_fused_decoder_routes_mlx_lm_attention_and_other_caches_are_untouched():
    fused.route_static_cache_attention()
    assert mlx_lm_qwen3.scaled_dot_product_attention is fused.static_cache_attention
    q, k, v = attention_inputs(4, 2, 3, 16, 12)
    plain = KVCache()
    plain.update_and_fetch(k, v)
    mask = mx.arange(12)[None] <= 9 + mx.arange(3)[:, None]
    got = fused.static_cache_attention(q, k, v, plain, 0.25, mask)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    assert mx.array_equal(got, want)


@pytest.mark.skipif(fixed_shapes_wanted(), reason="off CUDA only")
def test_off_cuda_a_static_cache_keeps_the_masked_attention():
    assert not buffer_attention.usable()
    q, k, v = attention_inputs(4, 2, 5, 64, 32)
    cache = fused.StaticKVCache(k, v, mx.array(20, mx.int32))
    got = fused.static_cache_attention(q, k, v, cache, 0.125, cache.make_mask(5))
    assert mx.array_equal(got, masked_attention(q, k, v, 20, 0.125))


def test_shape_supported_is_the_kernels_domain():
    q, k, _ = attention_inputs(4, 2, 7, 64, 16)
    assert buffer_attention.shape_supported(q, k)
    q16, k16, _ = attention_inputs(4, 2, 7, 16, 16)  # 32 lanes cannot split 16 values
    assert not buffer_attention.shape_supported(q16, k16)
    q3, k3, _ = attention_inputs(6, 4, 7, 64, 16)  # not whole GQA groups
    assert not buffer_attention.shape_supported(q3, k3)


@needs_cuda
@pytest.mark.parametrize("form", ["one_pass", "split", "two_pass", "mma"])
@pytest.mark.parametrize("heads,kv_heads,dim,rows,offset,slots", [
    (4, 2, 64, 7, 300, 512),  # the embedded model's verify (split: its rows in the second chunk)
    (4, 2, 64, 1, 0, 256),  # a chained draft step at the first slot
    (32, 8, 128, 5, 1000, 1280),  # a Qwen3-4B-like verify
    (8, 8, 64, 9, 40, 256),  # no GQA
    (4, 2, 96, 3, 250, 256),  # the last rows reach the end of the buffer
    (64, 8, 128, 1, 500, 768),  # Qwen3-32B's decode step at 512 tokens
    (64, 8, 128, 4, 250, 768),  # a depth-3 verify across the first chunk's end
    (32, 8, 128, 5, 8000, 8448),  # a long context (split: 66 chunks)
    (64, 8, 128, 9, 700, 1024),  # depth 8 on Qwen3-32B (split: 72 pairs, five blocks a chunk)
])
def test_kernel_matches_masked_attention(form, heads, kv_heads, dim, rows, offset, slots):
    attend = getattr(buffer_attention, f"{form}_buffer_attention")
    assert buffer_attention.usable() and {"one_pass": True, "split": buffer_attention.split_usable(),
                                          "two_pass": buffer_attention.two_pass_usable(),
                                          "mma": buffer_attention.mma_usable()}[form]
    q, k, v = attention_inputs(heads, kv_heads, rows, dim, slots, seed=rows)
    scale = 1 / math.sqrt(dim)
    got = attend(q, k, v, mx.array(offset, mx.int32), scale)
    want = masked_attention(q, k, v, offset, scale)
    assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), atol=2e-2, rtol=2e-2)


@needs_cuda
def test_each_row_rounds_as_an_ar_decode_step():
    """Row i equals, bit for bit, one query attending to the first offset+i+1 keys with no
    mask (MLX's vector kernel, what an AR step of mlx-lm's cache runs below 256 keys)."""
    q, k, v = attention_inputs(4, 2, 7, 64, 256, seed=3)
    offset, scale = 100, 1 / 8
    got = buffer_attention.buffer_attention(q, k, v, mx.array(offset, mx.int32), scale)
    for i in range(7):
        n = offset + i + 1
        step = mx.fast.scaled_dot_product_attention(q[:, :, i:i + 1], k[:, :, :n], v[:, :, :n], scale=scale)
        assert mx.array_equal(got[:, :, i:i + 1], step), f"row {i}"


@needs_cuda
@pytest.mark.parametrize("depth", [1, 4])
def test_fused_greedy_with_the_kernel_equals_ar(tiny_model_factory, depth):
    """A head size the kernel takes (64), so the fused verify and draft steps run it; 8-bit
    weights, so that K+1 rows and one row go through the same matrix-vector kernel."""
    model = load_model(tiny_model_factory("qwen3", head_dim=64, quantize_bits=8), decode_loop="fused")
    ids = model.tokenizer.encode("def add(a, b):\n    ret")

    def complete(d):
        request = GenerationRequest(ids, SamplingParams(max_tokens=60, ignore_eos=True), depth=d)
        return model.complete(request)

    assert complete(depth).token_ids == complete(0).token_ids


def rows_inputs(rows_count, heads, kv_heads, rows, dim, slots, seed=0):
    parts = [attention_inputs(heads, kv_heads, rows, dim, slots, seed=seed + i) for i in range(rows_count)]
    return [mx.concatenate([p[j] for p in parts]) for j in range(3)]


@pytest.mark.skipif(fixed_shapes_wanted(), reason="off CUDA only")
def test_off_cuda_a_rows_cache_keeps_each_rows_masked_attention():
    """A fused cohort's RowsKVCache: every row's attention is its own masked attention at
    its own offset (bitwise what the row's StaticKVCache gives alone)."""
    from mtplxd.engine.decoding.fused import RowsKVCache

    assert not buffer_attention.rows_usable()
    q, k, v = rows_inputs(3, 4, 2, 5, 64, 32)
    offsets = [20, 0, 27]
    cache = RowsKVCache(k, v, mx.array(offsets, mx.int32))
    got = fused.static_cache_attention(q, k, v, cache, 0.125, cache.make_mask(5))
    for i, offset in enumerate(offsets):
        want = masked_attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], offset, 0.125)
        assert mx.array_equal(got[i:i + 1], want), f"row {i}"


@needs_cuda
@pytest.mark.parametrize("form", ["one-pass", "split", "mma"])
def test_rows_kernel_gives_each_row_the_one_row_kernels_bits(monkeypatch, form):
    """The W-row kernels (fused cohorts) compute each row as the one-row kernel of the same
    form (the solo fused cycle) does, at that row's own offset: the one-pass rows kernel, and
    the split form's kernels over a batch (a row past its first chunk, one inside it)."""
    monkeypatch.setenv(buffer_attention.KERNEL_ENV, form)
    assert buffer_attention.rows_usable()
    q, k, v = rows_inputs(3, 4, 2, 7, 64, 512, seed=5)
    offsets, scale = [300, 0, 500], 1 / 8
    got = buffer_attention.rows_buffer_attention(q, k, v, mx.array(offsets, mx.int32), scale)
    for i, offset in enumerate(offsets):
        want = buffer_attention.buffer_attention(q[i:i + 1], k[i:i + 1], v[i:i + 1],
                                                 mx.array(offset, mx.int32), scale)
        assert mx.array_equal(got[i:i + 1], want), f"row {i}"


@pytest.mark.parametrize("value,form", [(None, "auto"), ("1", "auto"), ("Auto", "auto"), ("one-pass", "one-pass"),
                                        ("split", "split"), (" Two-Pass ", "two-pass"), ("0", None)])
def test_one_variable_picks_the_buffer_kernels_form(monkeypatch, value, form):
    """`MTPLX_BUFFER_ATTENTION`: unset, "1" or "auto" the default (`form_for` picks by
    shape), a form's name that form everywhere, "0" no kernel (MLX's masked attention)."""
    if value is None:
        monkeypatch.delenv(buffer_attention.KERNEL_ENV, raising=False)
    else:
        monkeypatch.setenv(buffer_attention.KERNEL_ENV, value)
    assert buffer_attention.form_wanted() == form
    assert buffer_attention.kernel_wanted() == (form is not None)


def test_an_unknown_form_is_logged_once_and_the_default_serves(monkeypatch, caplog):
    monkeypatch.setattr(buffer_attention, "_warned_values", set())
    monkeypatch.setenv(buffer_attention.KERNEL_ENV, "splti")
    with caplog.at_level("WARNING"):
        assert buffer_attention.form_wanted() == "auto"
        assert buffer_attention.form_wanted() == "auto"  # read again for the next layer
    assert "splti" in caplog.text and "two-pass" in caplog.text
    assert len([r for r in caplog.records if "splti" in r.getMessage()]) == 1


def shapes(heads: int, kv_heads: int, rows: int, dim: int, slots: int, dtype=mx.bfloat16) -> tuple[mx.array, mx.array]:
    """Queries and a key buffer of these shapes (zeros: `form_for` reads shapes alone)."""
    return mx.zeros((1, heads, rows, dim), dtype), mx.zeros((1, kv_heads, slots, dim), dtype)


def test_the_kernels_scalars_are_vectors_of_at_least_16_bytes():
    """MLX keeps arrays of 8 bytes or less in managed memory, which cost the kernels time to
    read (buffer_attention's SCALAR_VECTOR_ELEMENTS): the offsets and scale they take are
    padded past that, with the values in the elements the kernels read."""
    n = buffer_attention.SCALAR_VECTOR_ELEMENTS
    assert n * 4 >= 16
    one = buffer_attention.kernel_offsets(mx.array(300, mx.int32))
    assert one.dtype == mx.int32 and one.size >= n and one.tolist()[0] == 300
    two = buffer_attention.kernel_offsets(mx.array([7, 9], mx.uint32))  # a cohort of two rows
    assert two.dtype == mx.int32 and two.size >= n and two.tolist()[:2] == [7, 9]
    many = list(range(10, 10 + n + 2))
    assert buffer_attention.kernel_offsets(mx.array(many, mx.int32)).tolist() == many
    scale = buffer_attention.kernel_scale(0.125)
    assert scale.dtype == mx.float32 and scale.nbytes >= 16 and scale[0].item() == 0.125


def test_the_fused_caches_hold_their_offsets_as_views_of_the_padded_vector():
    """fused.static_caches and fused_cohort.rows_caches keep their offsets in device memory
    on CUDA: the same values and shape, a view of the vector the buffer kernels take, which
    they then reuse rather than pad again."""
    from mtplxd.engine.decoding import fused, fused_cohort

    buffers = [mx.zeros((1, 2, 8, 4)), mx.zeros((1, 2, 8, 4))] * 2
    caches = fused.static_caches(buffers, mx.array(5, mx.int32))
    assert caches[0].offset is caches[1].offset
    assert caches[0].offset.shape == () and caches[0].offset.dtype == mx.int32 and caches[0].offset.item() == 5
    padded = buffer_attention.kernel_offsets(caches[0].offset)
    assert padded.nbytes >= 16 and padded.tolist()[0] == 5
    rows = fused_cohort.rows_caches([mx.zeros((3, 2, 8, 4))] * 2, mx.array([1, 2, 3], mx.int32))
    assert rows[0].offset.tolist() == [1, 2, 3] and buffer_attention.kernel_offsets(rows[0].offset).tolist()[:3] == [1, 2, 3]
    other = mx.array(5, mx.uint32)  # not a loop's int32 offset: left as it is
    assert buffer_attention.in_device_memory(other) is other


def test_a_forwards_layers_share_one_padded_offset():
    """The layers of one forward pass one offset array: it is padded once, not once a layer;
    another offset array (the next forward's) gets its own."""
    offset = mx.array(41, mx.int32)
    first = buffer_attention.kernel_offsets(offset)
    assert buffer_attention.kernel_offsets(offset) is first
    following = buffer_attention.kernel_offsets(offset + 1)
    assert following is not first and following[0].item() == 42


@pytest.mark.parametrize("value,heads,kv_heads,rows,dim,slots,dtype,form", [
    # the default: from SPLIT_FROM_SLOTS slots mma where it takes the head, else split; one-pass below
    (None, 64, 8, 1, 128, 2048, mx.bfloat16, "mma"),
    (None, 64, 8, 4, 128, 8448, mx.bfloat16, "mma"),
    (None, 64, 8, 1, 128, 2047, mx.bfloat16, "one-pass"),
    (None, 8, 2, 1, 64, 2048, mx.float16, "mma"),
    (None, 24, 4, 4, 256, 8448, mx.bfloat16, "split"),  # the hybrid's attention: a head of 256
    (None, 8, 2, 2, 128, 8448, mx.float32, "split"),  # float32: no tensor-core input
    (None, 4, 2, 2, 256, 8448, mx.float32, "one-pass"),  # a key row past 512 bytes: outside the split kernel
    # a form asked for by name holds at every size, within its kernel's domain
    ("one-pass", 64, 8, 1, 128, 8448, mx.bfloat16, "one-pass"),
    ("split", 64, 8, 1, 128, 256, mx.bfloat16, "split"),
    ("split", 64, 8, 1, 128, 128, mx.bfloat16, "one-pass"),  # one chunk
    ("split", 4, 2, 2, 256, 8448, mx.float32, "one-pass"),  # a key row past 512 bytes
    ("two-pass", 64, 8, 4, 128, 300, mx.bfloat16, "two-pass"),
    # the mma form: 16-bit heads of up to 128, past one chunk; else the split form's rule
    ("mma", 64, 8, 4, 128, 8448, mx.bfloat16, "mma"),
    ("mma", 32, 8, 1, 128, 512, mx.float16, "mma"),
    ("mma", 8, 2, 3, 64, 300, mx.bfloat16, "mma"),
    ("mma", 64, 8, 1, 128, 256, mx.bfloat16, "one-pass"),  # one chunk
    ("mma", 24, 4, 4, 256, 8448, mx.bfloat16, "split"),  # the hybrid's head of 256
    ("mma", 8, 2, 2, 128, 8448, mx.float32, "split"),  # float32: no tensor-core input
    ("mma", 8, 2, 2, 48, 8448, mx.bfloat16, "one-pass"),  # 48 is no multiple of 32: no kernel of ours but one-pass
])
def test_the_form_follows_the_variable_and_the_shapes(monkeypatch, value, heads, kv_heads, rows, dim, slots,
                                                      dtype, form):
    if value is None:
        monkeypatch.delenv(buffer_attention.KERNEL_ENV, raising=False)
    else:
        monkeypatch.setenv(buffer_attention.KERNEL_ENV, value)
    assert buffer_attention.form_for(*shapes(heads, kv_heads, rows, dim, slots, dtype)) == form


def test_where_the_mma_forms_probe_failed_its_calls_take_the_split_form(monkeypatch):
    """The default picks the mma form by shape; a machine where its kernel did not pass its
    probe (the probe's answer is the GPU's, faked here) computes the same parts by the split
    form, and with neither probed in, the caller's one-pass kernel serves."""
    monkeypatch.setattr(buffer_attention, "mma_usable", lambda: False)
    monkeypatch.setattr(buffer_attention, "split_usable", lambda: True)
    assert buffer_attention._batched_form("mma") is buffer_attention.split_buffer_attention
    monkeypatch.setattr(buffer_attention, "split_usable", lambda: False)
    assert buffer_attention._batched_form("mma") is None
    monkeypatch.setattr(buffer_attention, "mma_usable", lambda: True)
    assert buffer_attention._batched_form("mma") is buffer_attention.mma_buffer_attention
    assert buffer_attention._batched_form("split") is None


def test_a_cohorts_rows_take_the_form_a_single_stream_with_their_buffers_would(monkeypatch):
    """W rows (fused cohorts) follow the same rule as a batch of one: a cohort row's form is
    its solo cycle's wherever their buffers have the same capacity."""
    monkeypatch.delenv(buffer_attention.KERNEL_ENV, raising=False)
    for slots, form in [(2048, "mma"), (2047, "one-pass")]:
        q, k = mx.zeros((3, 64, 4, 128), mx.bfloat16), mx.zeros((3, 8, slots, 128), mx.bfloat16)
        assert buffer_attention.mma_shape_supported(q, k)  # a batch of 3 is in the mma form's domain
        assert buffer_attention.form_for(q, k) == form


@pytest.mark.parametrize("form,name", [
    ("auto", f"buffer CUDA kernel: one pass below {buffer_attention.SPLIT_FROM_SLOTS} slots, from there on the "
             f"tensor cores in {buffer_attention.MMA_SLOTS}-slot chunks per KV head (16-bit heads of up to "
             f"{buffer_attention.MMA_MAX_DIM}), else split into {buffer_attention.SPLIT_SLOTS}-slot chunks per KV head"),
    ("split", f"buffer CUDA kernel, split into {buffer_attention.SPLIT_SLOTS}-slot chunks per KV head"),
    ("two-pass", f"buffer CUDA kernel, two passes over {buffer_attention.TWO_PASS_BLOCKS} key blocks per query head"),
    ("mma", f"buffer CUDA kernel on the tensor cores, {buffer_attention.MMA_SLOTS}-slot chunks per KV head")])
def test_the_forms_are_named(monkeypatch, form, name):
    """/health's `cache_attention` names the asked form where it runs (CUDA, probed);
    elsewhere the masked attention is named."""
    monkeypatch.setenv(buffer_attention.KERNEL_ENV, form)
    if not fixed_shapes_wanted():
        assert buffer_attention.path_name() == "mlx scaled_dot_product_attention"
        assert not buffer_attention.prepare_form()
    else:
        assert buffer_attention.prepare_form() and buffer_attention.path_name() == name


def test_the_kernel_can_be_turned_off(monkeypatch):
    """`MTPLX_BUFFER_ATTENTION=0` leaves the fused loops on MLX's masked attention (read by
    `usable` at each call, after its probe passed once; by `rows_usable` once per process)."""
    monkeypatch.delenv(buffer_attention.KERNEL_ENV, raising=False)
    assert buffer_attention.kernel_wanted()
    monkeypatch.setenv(buffer_attention.KERNEL_ENV, "0")
    assert not buffer_attention.kernel_wanted()
    monkeypatch.setattr(buffer_attention, "_usable", None)
    monkeypatch.setattr(buffer_attention, "_rows_usable", None)
    assert not buffer_attention.usable() and not buffer_attention.rows_usable()
    assert buffer_attention.path_name() == "mlx scaled_dot_product_attention"
    monkeypatch.setattr(buffer_attention, "_usable", True)  # as after a probe that passed
    assert not buffer_attention.usable()
    monkeypatch.setenv(buffer_attention.KERNEL_ENV, "one-pass")
    assert buffer_attention.usable() and buffer_attention.path_name() == "buffer CUDA kernel"


def test_split_shape_supported_is_the_split_kernels_domain():
    """A key row of 512 bytes at most: a head size of 256 in bf16 fits, in float32 it does
    not; any number of (query head, row) pairs (several blocks a chunk), at most 4 a warp, 2
    where a key row passes 256 bytes, fewer in blocks of more warps (the staged tile and the
    queries within 48 KB of shared memory)."""
    q9, k9, _ = attention_inputs(64, 8, 9, 128, 16)  # a group of 8 over 9 verify rows: 72 pairs
    assert buffer_attention.split_shape_supported(q9, k9)
    q256, k256, _ = attention_inputs(8, 2, 4, 256, 16)
    assert buffer_attention.split_shape_supported(q256, k256)
    assert not buffer_attention.split_shape_supported(q256.astype(mx.float32), k256.astype(mx.float32))
    assert [buffer_attention.split_max_pairs(d, size) for d, size in [(128, 2), (64, 4), (256, 2), (128, 4)]] == [4, 4, 2, 2]
    assert [buffer_attention.split_max_pairs(d, size, 8) for d, size in [(128, 2), (256, 2), (128, 4)]] == [4, 1, 2]


@needs_cuda
@pytest.mark.parametrize("form", ["split", "two_pass", "mma"])
def test_the_split_forms_rows_do_not_depend_on_the_buffers_capacity(form):
    """The same keys in a larger buffer (the AR loop's and the cycle's buffers need not be
    the same size) give the same bits: the split form's chunks past a row's keys add exact
    zeros; the two-pass form's warps take keys by slot and never read past a row's limit."""
    attend = getattr(buffer_attention, f"{form}_buffer_attention")
    q, k, v = attention_inputs(16, 4, 4, 128, 1280, seed=4)
    offset, scale = mx.array(600, mx.int32), 1 / math.sqrt(128)
    large = attend(q, k, v, offset, scale)
    small = attend(q, k[:, :, :700], v[:, :, :700], offset, scale)
    assert mx.array_equal(large, small)


@needs_cuda
@pytest.mark.parametrize("form,heads,kv_heads,rows,offset,slots", [
    # split: across a chunk boundary; 24 pairs (two blocks a chunk), and 72 (five)
    ("split", 16, 4, 6, 2 * buffer_attention.SPLIT_SLOTS - 3, 1024),
    ("split", 64, 8, 9, 2 * buffer_attention.SPLIT_SLOTS - 3, 1024),
    # two-pass: across a round of blocks' end; 9 rows take blocks of 8 and of 1
    ("two_pass", 16, 4, 6, 509, 765),
    ("two_pass", 64, 8, 4, 8000, 8256),
    ("two_pass", 8, 2, 9, 300, 556),
    # mma: across a chunk's end; 24 pairs (two slices), 72 (five), and a verify's rows at 8k
    # tokens (8,006-8,009) in both 8-slot halves of one warp's 16-slot step
    ("mma", 16, 4, 6, 2 * buffer_attention.MMA_SLOTS - 3, 1024),
    ("mma", 64, 8, 9, 2 * buffer_attention.MMA_SLOTS - 3, 1024),
    ("mma", 64, 8, 4, 8006, 8448),
])
def test_the_split_forms_round_each_verify_row_as_its_one_row_step(form, heads, kv_heads, rows, offset, slots):
    """Row i of a K+1-row call equals, bit for bit, the 1-row call at position offset+i (the
    compiled AR step's): the split form's chunks are fixed by slot, not by rows, and a pair
    computes alike in whichever block and warp serves it; the two-pass form's rows share
    each key's loads, not its arithmetic."""
    attend = getattr(buffer_attention, f"{form}_buffer_attention")
    q, k, v = attention_inputs(heads, kv_heads, rows, 128, slots, seed=6)
    scale = 1 / math.sqrt(128)
    verify = attend(q, k, v, mx.array(offset, mx.int32), scale)
    for i in range(rows):
        step = attend(q[:, :, i:i + 1], k, v, mx.array(offset + i, mx.int32), scale)
        assert mx.array_equal(verify[:, :, i:i + 1], step), f"row {i}"


@needs_cuda
@pytest.mark.parametrize("form", ["split", "two_pass", "mma"])
def test_buffer_attention_takes_the_asked_form(monkeypatch, form):
    """(The split form past one chunk: this buffer has three.)"""
    monkeypatch.setenv(buffer_attention.KERNEL_ENV, form.replace("_", "-"))
    q, k, v = attention_inputs(8, 2, 3, 64, 768, seed=7)
    offset = mx.array(600, mx.int32)
    assert mx.array_equal(buffer_attention.buffer_attention(q, k, v, offset, 0.125),
                          getattr(buffer_attention, f"{form}_buffer_attention")(q, k, v, offset, 0.125))


@needs_cuda
def test_by_default_a_cohorts_large_buffers_take_the_mma_form_too(monkeypatch):
    monkeypatch.delenv(buffer_attention.KERNEL_ENV, raising=False)
    q, k, v = rows_inputs(2, 8, 2, 3, 128, buffer_attention.SPLIT_FROM_SLOTS, seed=10)
    offsets = mx.array([buffer_attention.SPLIT_FROM_SLOTS - 300, 40], mx.int32)
    assert mx.array_equal(buffer_attention.rows_buffer_attention(q, k, v, offsets, 0.125),
                          buffer_attention.mma_buffer_attention(q, k, v, offsets, 0.125))


@needs_cuda
def test_by_default_a_large_buffer_takes_the_mma_form_or_for_a_head_of_256_the_split_form(monkeypatch):
    monkeypatch.delenv(buffer_attention.KERNEL_ENV, raising=False)
    q, k, v = attention_inputs(8, 2, 2, 128, buffer_attention.SPLIT_FROM_SLOTS, seed=9)
    offset = mx.array(buffer_attention.SPLIT_FROM_SLOTS - 300, mx.int32)
    assert mx.array_equal(buffer_attention.buffer_attention(q, k, v, offset, 0.125),
                          buffer_attention.mma_buffer_attention(q, k, v, offset, 0.125))
    q2, k2, v2 = attention_inputs(6, 1, 2, 256, buffer_attention.SPLIT_FROM_SLOTS, seed=11)  # the hybrid's head
    assert mx.array_equal(buffer_attention.buffer_attention(q2, k2, v2, offset, 0.0625),
                          buffer_attention.split_buffer_attention(q2, k2, v2, offset, 0.0625))
    small = buffer_attention.buffer_attention(q, k[:, :, :1024], v[:, :, :1024], mx.array(700, mx.int32), 0.125)
    assert mx.array_equal(small, buffer_attention.one_pass_buffer_attention(
        q, k[:, :, :1024], v[:, :, :1024], mx.array(700, mx.int32), 0.125))


@needs_cuda
def test_outside_the_split_kernels_domain_the_one_pass_kernel_serves(monkeypatch):
    monkeypatch.setenv(buffer_attention.KERNEL_ENV, "split")
    offset = mx.array(600, mx.int32)
    q2, k2, v2 = (x.astype(mx.float32) for x in attention_inputs(4, 2, 2, 256, 768, seed=8))  # a float32 head of 256
    asked = buffer_attention.buffer_attention(q2, k2, v2, offset, 0.125)
    monkeypatch.delenv(buffer_attention.KERNEL_ENV)
    assert mx.array_equal(asked, buffer_attention.buffer_attention(q2, k2, v2, offset, 0.125))


def test_a_kernel_built_by_editing_another_fails_loudly_when_an_edit_misses():
    """The rows kernel is the one-pass source with edits; an edit whose text is not found
    exactly once raises at import rather than leaving a kernel that indexes wrongly."""
    assert "blockIdx.z" in buffer_attention._ROWS_SOURCE
    with pytest.raises(ValueError, match="found 0 times"):
        buffer_attention._edited(buffer_attention._SOURCE, ("no such text", "x"))


@needs_cuda
def test_the_mma_form_takes_half_precision_and_views_off_a_16_byte_boundary():
    """float16 inputs (the other tensor-core type), and a key buffer and queries that MLX
    passes one element past a 16-byte boundary (views into flat arrays): the keys staged by
    plain loads, the queries read 16 bits at a time."""
    q, k, v = attention_inputs(8, 2, 3, 64, 700, seed=11)
    q, k, v = (x.astype(mx.float16) for x in (q, k, v))
    got = buffer_attention.mma_buffer_attention(q, k, v, mx.array(500, mx.int32), 0.125)
    want = masked_attention(q, k, v, 500, 0.125)
    assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), atol=2e-2, rtol=2e-2)
    flat = mx.concatenate([mx.zeros((1,), mx.bfloat16), attention_inputs(8, 2, 3, 64, 700, seed=12)[1].reshape(-1)])
    k_odd = flat[1:].reshape(1, 2, 700, 64)  # one element past the start
    q2, _, v2 = attention_inputs(8, 2, 3, 64, 700, seed=12)
    q2 = mx.concatenate([mx.zeros((1,), mx.bfloat16), q2.reshape(-1)])[1:].reshape(q2.shape)
    got = buffer_attention.mma_buffer_attention(q2, k_odd, v2, mx.array(500, mx.int32), 0.125)
    want = masked_attention(q2, k_odd, v2, 500, 0.125)
    assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), atol=2e-2, rtol=2e-2)


def test_mma_shape_supported_is_the_mma_kernels_domain():
    """16-bit queries and buffers of one dtype, a head size up to 128 (a multiple of 32, as
    every buffer kernel takes; the mma form's own need is 16); its
    shared memory: 4 warps' two stages of 16 keys and 16 values (69,632 bytes at 128 in bf16),
    which then hold the warps' results (33,792)."""
    q, k, _ = attention_inputs(64, 8, 4, 128, 512)
    assert buffer_attention.mma_shape_supported(q, k)
    assert buffer_attention.mma_shape_supported(q.astype(mx.float16), k.astype(mx.float16))
    assert not buffer_attention.mma_shape_supported(q.astype(mx.float32), k.astype(mx.float32))
    assert not buffer_attention.mma_shape_supported(q, k.astype(mx.float16))
    q256, k256, _ = attention_inputs(8, 2, 4, 256, 512)
    assert not buffer_attention.mma_shape_supported(q256, k256)
    assert buffer_attention.mma_shared_bytes(128, 2) == 4 * 2 * 2 * 16 * 136 * 2 == 69_632
    assert buffer_attention.mma_shared_bytes(64, 2) == max(4 * 2 * 2 * 16 * 72 * 2, 4 * 16 * 66 * 4)


NVCC = shutil.which("nvcc")

# MLX's kernel signature and what its default header gives a body (mlx/backend/cuda/custom_kernel.cpp
# and device/utils.cuh: `Shape`, the `cg` alias, `Limits`), for a compile without a GPU.
_MLX_PRELUDE = """#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <cfloat>
#include <cooperative_groups.h>
#include <cuda/std/array>
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, 8>;
template <typename U> struct Limits { __device__ static constexpr U finite_min() { return -FLT_MAX; } };
}
"""


def _mlx_kernel(name: str, source: str, inputs: list[tuple[str, str]], outputs: list[tuple[str, str]],
                constants: dict[str, object]) -> str:
    """`source` as mx.fast.cuda_kernel wraps it: typed inputs with their shapes, outputs, constants."""
    params, lines = cuda_emulator.signature(inputs, outputs, constants, "const __grid_constant__ Shape")
    return (f"namespace mlx::core::cu {{\nnamespace cg = cooperative_groups;\n"
            f"__global__ void {name}({', '.join(params)}) {{\n{lines}{custom_kernels.compact(source)}\n}}\n}}\n")


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed here")
def test_the_split_and_mma_forms_compile_for_the_h200_without_spills(tmp_path):
    """The split form's first pass, its merge and the mma form, as MLX builds them (bf16 and
    fp16, head sizes 64 and 128), compile for sm_90 with no register spilled."""
    attend_inputs = [("queries", "T"), ("keys", "T"), ("values", "T"), ("offset", "int32_t"), ("scale", "float")]
    parts = [("part_max", "float"), ("part_sum", "float"), ("part_acc", "float")]
    kernels = []
    for dtype, bf16 in (("__nv_bfloat16", True), ("__half", False)):
        for dim in (64, 128):
            kernels.append(_mlx_kernel(f"mma_{bf16}_{dim}", buffer_attention._MMA_SOURCE, attend_inputs, parts,
                                       {"T": dtype, "D": dim, "CHUNK": buffer_attention.MMA_SLOTS,
                                        "WARPS": buffer_attention.MMA_WARPS, "BF16": bf16}))
    kernels.append(_mlx_kernel("split_128", buffer_attention._SPLIT_SOURCE, attend_inputs, parts,
                               {"T": "__nv_bfloat16", "D": 128, "CHUNK": buffer_attention.SPLIT_SLOTS,
                                "PAIRS": 4, "WARPS": buffer_attention.SPLIT_WARPS}))
    kernels.append(_mlx_kernel("merge_128", buffer_attention._MERGE_SOURCE,
                               [("part_max", "float"), ("part_sum", "float"), ("part_acc", "float"),
                                ("offset", "int32_t")], [("out", "T")],
                               {"T": "__nv_bfloat16", "D": 128, "CHUNK": buffer_attention.MMA_SLOTS}))
    header = custom_kernels.TENSOR_CORE_HEADER + buffer_attention._HEADER + buffer_attention._MMA_HEADER
    path = tmp_path / "buffer_attention.cu"
    path.write_text(_MLX_PRELUDE + custom_kernels.compact(header) + "".join(kernels))
    done = subprocess.run([NVCC, "-arch=sm_90", "-std=c++17", "-c", str(path), "-o", str(tmp_path / "k.o"),
                           "-Xptxas", "-v"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    spills = [line for line in done.stderr.splitlines() if "spill stores" in line]
    assert len(spills) == 6 and all(" 0 bytes spill stores" in line for line in spills), done.stderr


# The mma form's logic on the CPU (tests/support/cuda_emulator.py: the kernel's own source,
# its threads as OS threads, mma.sync from the PTX ISA's fragment layouts), with the split
# form's merge in numpy: what a GPU would run, checked where none is lent.
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed here")


def emulated_mma_attention(tmp_path, q, k, v, offsets, scale, bf16=True, chunk=None, warps=None):
    """The mma form's first pass, emulated, and the merge (`_MERGE_SOURCE`'s sums) in numpy:
    q (W, Hq, L, D), k and v (W, Hkv, S, D) as bf16 (or, not `bf16`, fp16) bit patterns, one
    offset a batch row; in chunks of `chunk` slots and blocks of `warps` warps (MMA_SLOTS and
    MMA_WARPS unless told)."""
    batch, heads, rows, dim = q.shape
    kv_heads, slots = k.shape[1], k.shape[2]
    chunk, warps = chunk or buffer_attention.MMA_SLOTS, warps or buffer_attention.MMA_WARPS
    chunks, slices = -(-slots // chunk), -(-(heads // kv_heads * rows) // 16)
    library = cuda_emulator.build(
        "mma", buffer_attention._MMA_SOURCE, buffer_attention._HEADER + buffer_attention._MMA_HEADER,
        [("queries", "T"), ("keys", "T"), ("values", "T"), ("offset", "int32_t"), ("scale", "float")],
        [("part_max", "float"), ("part_sum", "float"), ("part_acc", "float")],
        {"T": "__nv_bfloat16" if bf16 else "__half", "D": dim, "CHUNK": chunk, "WARPS": warps, "BF16": bf16},
        tmp_path)
    part_max = np.full((batch, heads, rows, chunks), np.nan, np.float32)
    part_sum = np.full_like(part_max, np.nan)
    part_acc = np.full((batch, heads, rows, chunks, dim), np.nan, np.float32)
    at = np.array(list(offsets) + [0] * 3, np.int32)
    cuda_emulator.launch(library, [q, k, v, at, np.full(4, scale, np.float32)], [part_max, part_sum, part_acc],
                         (batch * kv_heads * slices, chunks, 1), 32 * warps,
                         buffer_attention.mma_shared_bytes(dim, 2, warps))
    out = np.zeros((batch, heads, rows, dim), np.float32)
    for b in range(batch):
        for r in range(rows):
            count = min(chunks, (offsets[b] + r + chunk) // chunk)  # the chunks below the row's limit
            top = part_max[b, :, r, :count].max(axis=-1, keepdims=True)
            weight = np.exp2(part_max[b, :, r, :count] - top)
            out[b, :, r] = ((weight[..., None] * part_acc[b, :, r, :count]).sum(axis=1)
                            / (weight * part_sum[b, :, r, :count]).sum(axis=1)[:, None])
    return out


def reference_attention(q, k, v, offsets, scale, bf16=True):
    """float64 attention over the bf16 (fp16) values, row r of batch row b seeing slots <= offset + r."""
    qf, kf, vf = ((cuda_emulator.bf16_values(x) if bf16 else x.view(np.float16)).astype(np.float64) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    kf, vf = np.repeat(kf, group, axis=1), np.repeat(vf, group, axis=1)
    scores = np.einsum("bhrd,bhsd->bhrs", qf, kf) * scale
    slots = np.arange(k.shape[2])
    for b, offset in enumerate(offsets):
        visible = slots[None, :] <= offset + np.arange(q.shape[2])[:, None]
        scores[b] = np.where(visible[None], scores[b], -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return np.einsum("bhrs,bhsd->bhrd", weights / weights.sum(axis=-1, keepdims=True), vf)


def half_precision_inputs(batch, heads, kv_heads, rows, dim, slots, seed, bf16=True):
    def bits(x):
        return cuda_emulator.bf16_bits(x) if bf16 else x.astype(np.float16).view(np.uint16)

    rng = np.random.default_rng(seed)
    return [bits(rng.standard_normal(shape).astype(np.float32))
            for shape in ((batch, heads, rows, dim), (batch, kv_heads, slots, dim), (batch, kv_heads, slots, dim))]


@needs_gxx
@pytest.mark.parametrize("heads,kv_heads,rows,dim,offsets,slots,bf16", [
    (8, 2, 3, 64, [356], 552, True),  # the probe's shape: one slice, three chunks, the last one short
    (16, 2, 4, 128, [500], 600, True),  # a Qwen3-32B-like group of 8 at four rows: two slices; a chunk's end crossed
    (8, 4, 7, 64, [300, 20], 520, True),  # a cohort of two rows at their own offsets
    (8, 2, 2, 64, [400], 520, False),  # float16
])
def test_the_mma_form_emulated_matches_attention(tmp_path, heads, kv_heads, rows, dim, offsets, slots, bf16):
    q, k, v = half_precision_inputs(len(offsets), heads, kv_heads, rows, dim, slots, seed=rows, bf16=bf16)
    scale = 1 / math.sqrt(dim)
    got = emulated_mma_attention(tmp_path, q, k, v, offsets, scale, bf16=bf16)
    want = reference_attention(q, k, v, offsets, scale, bf16=bf16)
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() < 1e-2  # the weights rounded to bf16 before they weigh the values


@needs_gxx
@pytest.mark.parametrize("chunk,warps", [(128, 8), (64, 4), (512, 2), (256, 8)])
def test_the_mma_forms_other_chunks_and_warps_emulated_match_attention(tmp_path, chunk, warps):
    """The chunk and the warps a block has are the kernel's template (attention_profile's
    --mma-slots and --mma-warps time them): a warp's 16-slot steps from one (128 slots over 8
    warps) to eight (512 over 2), over chunk ends and a short last chunk."""
    q, k, v = half_precision_inputs(1, 16, 2, 4, 128, 600, seed=chunk + warps)
    offsets, scale = [500], 1 / math.sqrt(128)
    got = emulated_mma_attention(tmp_path, q, k, v, offsets, scale, chunk=chunk, warps=warps)
    assert np.abs(got - reference_attention(q, k, v, offsets, scale)).max() < 1e-2


@needs_gxx
def test_the_mma_form_emulated_rounds_each_verify_row_as_its_one_row_call(tmp_path):
    """Row i of a 4-row call equals, bit for bit, the 1-row call at offset + i: keys masked for
    a pair add exact zeros (and slots past the call's rows are staged as zeros, never as the
    stage's earlier contents)."""
    q, k, v = half_precision_inputs(1, 16, 2, 4, 128, 600, seed=9)
    offset, scale = 509, 1 / math.sqrt(128)  # rows 509-512: a chunk's end and a warp's step crossed
    verify = emulated_mma_attention(tmp_path, q, k, v, [offset], scale)
    for i in range(4):
        step = emulated_mma_attention(tmp_path, np.ascontiguousarray(q[:, :, i:i + 1]), k, v, [offset + i], scale)
        assert np.array_equal(verify[:, :, i:i + 1], step), f"row {i}"
