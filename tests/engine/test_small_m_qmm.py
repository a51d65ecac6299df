"""The small-M quantized matmul kernel (small_m_qmm.py): its plain-ops reference pins the
layout the kernel reads against mx.quantized_matmul on this CPU; off CUDA nothing changes and
the status says so; on CUDA (through the device) the kernel matches the float32 truth and
keeps greedy MTP equal to AR."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from mtplxd.engine import GenerationRequest, SamplingParams, load_model
from mtplxd.engine.model import custom_kernels, small_m_qmm
from mtplxd.engine.model.kv_cache import fixed_shapes_wanted

ON_CUDA = fixed_shapes_wanted()
needs_cuda = pytest.mark.skipif(not ON_CUDA, reason="the kernel is CUDA only; this machine runs MLX on the CPU")


# Row counts to check: every verify of one row (1..8), more rows than one block keeps
# (ROW_CHUNK), a 3-wide cohort at depth 6 (21) and more: the kernel takes any row count,
# though `route` gives it at most MAX_ROWS.
ROW_COUNTS = (*range(1, 9), 9, 16, 21, 56, 64)


@pytest.mark.parametrize("bits", small_m_qmm.BITS)
@pytest.mark.parametrize("rows", ROW_COUNTS)
def test_reference_equals_mx_quantized_matmul_in_float32(bits, rows):
    """The reference's arithmetic, on the CPU on every machine: it is the kernel's CPU twin, and
    CUDA's float32 matmuls of several rows round further than 1e-5 (probe_case's docstring)."""
    x, w, scales, biases, truth = small_m_qmm.probe_case(rows, bits, N=96, K=256, dtype=mx.float32)
    with mx.stream(mx.cpu):
        assert small_m_qmm.relative_error(small_m_qmm.reference(x, w, scales, biases, bits), truth) < 1e-5


def test_reference_keeps_leading_dimensions_and_dtype():
    x, w, scales, biases, truth = small_m_qmm.probe_case(4, 4, N=64, K=128, dtype=mx.bfloat16)
    out = small_m_qmm.reference(x.reshape(1, 4, 128), w, scales, biases, 4)
    assert out.shape == (1, 4, 64) and out.dtype == mx.bfloat16
    assert small_m_qmm.relative_error(out.reshape(4, 64), truth) < 0.02


def test_the_kernel_domain_is_few_rows_of_affine_4_and_8_bit_groups_of_64():
    layer = nn.QuantizedLinear(128, 64, bias=False, group_size=64, bits=4)
    assert small_m_qmm.supported(mx.zeros((1, 6, 128)), layer)
    assert small_m_qmm.supported(mx.zeros((1, 3, 128)), layer)
    assert not small_m_qmm.supported(mx.zeros((1, 2, 128)), layer)  # decode: MLX's matvec is faster
    eight = nn.QuantizedLinear(128, 64, bias=False, group_size=64, bits=8)
    assert not small_m_qmm.supported(mx.zeros((1, 3, 128)), eight)
    assert small_m_qmm.supported(mx.zeros((1, 4, 128)), eight)
    assert small_m_qmm.supported(mx.zeros((1, small_m_qmm.MAX_ROWS, 128)), layer)
    assert not small_m_qmm.supported(mx.zeros((1, small_m_qmm.MLX_TILED_ROWS, 128)), layer)  # MLX's tiled qmm
    assert not small_m_qmm.supported(mx.zeros((3, 7, 128)), layer)  # a cohort's verify: 21 rows, MLX's
    assert not small_m_qmm.supported(mx.zeros((1, small_m_qmm.MAX_ROWS + 1, 128)), layer)  # prefill: MLX's
    assert not small_m_qmm.supported(mx.zeros((1, 1, 128), mx.int32), layer)
    assert not small_m_qmm.supported(mx.zeros((1, 1, 128)), nn.QuantizedLinear(128, 64, group_size=32, bits=4))
    assert not small_m_qmm.supported(mx.zeros((1, 1, 128)), nn.QuantizedLinear(128, 64, group_size=64, bits=3))


def _quantized(out_dims: int, in_dims: int, bits: int) -> nn.QuantizedLinear:
    """A quantized layer of that shape without quantizing a large float matrix on the CPU."""
    layer = nn.QuantizedLinear(64, 64, bias=False, group_size=64, bits=bits)
    layer.weight = mx.zeros((out_dims, in_dims * bits // 32), dtype=mx.uint32)
    return layer


def test_the_kernel_is_on_by_default_only_for_large_quantized_models(tiny_model_factory):
    """Where whole forwards measured it faster (a dense 32B at 4- and 8-bit, the hybrid 27B's
    verify blocks, a dense 4-bit 4B's decode steps), not where it measured slower (the
    embedded model at 8-bit, the hybrid 27B's decode steps)."""
    from mtplxd.engine.bench import real_size

    def model(*layers):
        return nn.Sequential(*layers)

    q_proj = (8192, 5120)  # Qwen3-32B: 42M weights, at VERIFY_VECTOR_VALUES
    k_proj = (1024, 5120)
    assert small_m_qmm.default_wanted(model(_quantized(*q_proj, 4), _quantized(*k_proj, 4)))
    assert small_m_qmm.default_wanted(model(_quantized(*q_proj, 8), _quantized(*k_proj, 8)))
    assert not small_m_qmm.default_wanted(model(_quantized(*q_proj, 4), _quantized(*k_proj, 8)))
    hybrid, _ = real_size.build_model("tiny-hybrid", "4bit")
    hybrid.append_big = _quantized(*q_proj, 4)  # a 27B-sized matrix in a model with DeltaNet layers
    assert small_m_qmm.default_wanted(hybrid) and not small_m_qmm.decode_wanted(hybrid)
    assert small_m_qmm.decode_wanted(model(_quantized(*q_proj, 4)))
    assert not small_m_qmm.decode_wanted(model(_quantized(*q_proj, 8)))  # 8-bit: MLX's matvec was faster
    installed = model(_quantized(*q_proj, 4))
    installed.layers[0].__class__ = small_m_qmm.SmallMQuantizedLinear  # as /health asks it, after install
    assert small_m_qmm.decode_wanted(installed)
    # Qwen3-4B's largest (the MLP's, 25M weights): its 4-bit decode steps take the kernel, its
    # verify blocks and MTP cycles keep the mixed routing; 8-bit stays on MLX.
    four_b = model(_quantized(2560, 9728, 4), _quantized(4096, 2560, 4))
    assert small_m_qmm.default_wanted(four_b) and small_m_qmm.decode_wanted(four_b)
    assert not small_m_qmm.verify_wanted(four_b) and not small_m_qmm.cycle_row_invariant_wanted(four_b)
    assert not small_m_qmm.row_invariant_wanted(four_b)
    assert not small_m_qmm.default_wanted(model(_quantized(2560, 9728, 8)))
    assert not small_m_qmm.default_wanted(model(_quantized(2048, 6144, 4)))  # Qwen3-1.7B's: 12.6M
    assert small_m_qmm.verify_wanted(model(_quantized(*q_proj, 4)))
    assert small_m_qmm.cycle_row_invariant_wanted(model(_quantized(*q_proj, 4)))
    assert not small_m_qmm.row_invariant_wanted(model(_quantized(*q_proj, 4)))  # dense 4-bit: in its cycles only
    assert small_m_qmm.row_invariant_wanted(model(_quantized(*q_proj, 8), _quantized(*k_proj, 8)))  # dense 8-bit
    assert not small_m_qmm.default_wanted(model(nn.Linear(64, 64)))
    assert not small_m_qmm.default_wanted(load_model(tiny_model_factory("qwen3", quantize_bits=4)).model)


@pytest.mark.skipif(ON_CUDA, reason="the fallback is what runs off CUDA")
def test_off_cuda_install_changes_nothing_and_says_why(tiny_model_factory):
    assert not small_m_qmm.usable()
    model = load_model(tiny_model_factory("qwen3", quantize_bits=4), dequantize_weights="off")
    assert small_m_qmm.install(model.model, force=True) == 0
    assert not any(isinstance(m, small_m_qmm.SmallMQuantizedLinear) for _, m in model.model.named_modules())
    assert model.info.kernels["quantized_matmul"] == "mlx (the small-M kernel is CUDA only)"
    asked = load_model(tiny_model_factory("qwen3", quantize_bits=4), small_m_kernel=True, dequantize_weights="off")  # as the benches ask
    assert asked.info.kernels["quantized_matmul"] == "mlx (the small-M kernel is CUDA only)"
    request = GenerationRequest(model.tokenizer.encode("def f(x):"), SamplingParams(max_tokens=8))
    assert len(model.complete(request).token_ids) == 8


def test_a_hybrid_model_names_its_gdn_verify_and_decode_paths(tiny_model_factory):
    info = load_model(tiny_model_factory("qwen3")).info
    assert "gdn_verify" not in info.kernels and "gdn_decode" not in info.kernels
    hybrid = load_model(tiny_model_factory("qwen3_5")).info
    assert hybrid.kernels["gdn_verify"] == ("chunked" if ON_CUDA else "per-token")
    assert hybrid.kernels["gdn_decode"] == ("CUDA kernel" if ON_CUDA else "mlx-lm ops")
    # An AR request's step: compiled for hybrids on CUDA, op by op elsewhere (fused_ar.py; a dense
    # model whose decode steps take the kernel is compiled too, for short prompts: test_fused_ar.py).
    assert hybrid.kernels["ar_decode"] == ("compiled" if ON_CUDA else "op by op")
    assert info.kernels["ar_decode"] == "op by op"


@needs_cuda
@pytest.mark.parametrize("bits", small_m_qmm.BITS)
@pytest.mark.parametrize("rows", ROW_COUNTS)
@pytest.mark.parametrize("layout", small_m_qmm.LAYOUTS)
def test_cuda_kernel_matches_the_float32_truth(bits, rows, layout):
    for N, K in ((320, 512), (2560, 2560), (999, 1024)):
        assert small_m_qmm.probe_error(rows, bits, layout, N=N, K=K) < 0.01


@needs_cuda
@pytest.mark.parametrize("bits", small_m_qmm.BITS)
@pytest.mark.parametrize("layout", ["word", "vector"])  # the mma layout converts nothing
def test_cuda_and_or_unpack_gives_the_conversions_outputs_bit_for_bit(bits, layout):
    """The unpack without int-to-float conversions (small_m_qmm._HEADER) yields the same floats,
    so the kernel's outputs do not move by a bit."""
    for rows in (1, 3, 6, 9):
        x, w, scales, biases, _ = small_m_qmm.probe_case(rows, bits, N=999, K=1024)
        unpacked = small_m_qmm.small_m_matmul(x, w, scales, biases, bits, layout=layout)
        converted = small_m_qmm.small_m_matmul(x, w, scales, biases, bits, layout=layout, convert=True)
        assert mx.array_equal(unpacked, converted).item()


@pytest.mark.parametrize("bits", small_m_qmm.BITS)
def test_the_in_place_unpack_times_its_input_scale_gives_each_product_exactly(bits):
    """_HEADER's mtplx_unpack_word_in_place, spelled in numpy float32: value i of a word masked
    in place under 2^23's exponent, less 2^23, is q * 2^(BITS j) exactly (j its place in its
    half-word), and with the input scaled by mtplx_in_place_scale (2^-(BITS j)) every product
    is the float x * q, so the vector layout's sums cannot move."""
    import numpy as np

    rng = np.random.default_rng(bits)
    words = rng.integers(0, 2**32, size=4096, dtype=np.uint64).astype(np.uint32)
    x = rng.standard_normal(4096 * 32 // bits).astype(np.float32).reshape(4096, -1)
    per_half, mask = 16 // bits, (1 << bits) - 1
    for i in range(32 // bits):
        half, j = divmod(i, per_half)
        h = words >> np.uint32(16) if half else words
        placed = ((h & np.uint32(mask << (bits * j))) | np.uint32(0x4B000000)).view(np.float32)
        value = placed - np.float32(2.0**23)
        q = ((words >> np.uint32(16 * half + bits * j)) & np.uint32(mask)).astype(np.float32)
        assert np.array_equal(value, q * np.float32(2.0 ** (bits * j)))
        scale = np.float32(1.0 / (1 << (bits * (i % per_half))))  # mtplx_in_place_scale<BITS>(i)
        assert np.array_equal((x[:, i] * scale) * value, x[:, i] * q)


@needs_cuda
@pytest.mark.parametrize("bits", small_m_qmm.BITS)
@pytest.mark.parametrize("dtype", small_m_qmm.MMA_DTYPES)
def test_cuda_vector_layout_unpacked_in_place_gives_the_masked_outputs_bit_for_bit(bits, dtype):
    """Unpacked in place, the vector layout's outputs are the masked unpack's bit for bit; with
    a group's bias once a vector too, as near the float32 truth."""
    for rows in (1, 3, 6, 9):
        x, w, scales, biases, truth = small_m_qmm.probe_case(rows, bits, N=999, K=1024, dtype=dtype)
        in_place = small_m_qmm.small_m_matmul(x, w, scales, biases, bits, layout="vector", in_place=True,
                                              bias_once=False)
        masked = small_m_qmm.small_m_matmul(x, w, scales, biases, bits, layout="vector", in_place=False,
                                            bias_once=False)
        assert mx.array_equal(in_place, masked).item()
        truth_error = small_m_qmm.relative_error(masked, truth)
        bias_once = small_m_qmm.small_m_matmul(x, w, scales, biases, bits, layout="vector", in_place=True,
                                               bias_once=True)
        assert small_m_qmm.relative_error(bias_once, truth) < max(0.01, 1.5 * truth_error)


def test_the_vector_layouts_persistent_form_takes_fewer_blocks_than_column_blocks_only():
    w = mx.zeros((999, 1024 * 4 // 32), mx.uint32)  # 999 rows of K = 1,024 at 4-bit: 32 vectors a row
    assert small_m_qmm.vector_grid(w, 8) == (32, 125, False)  # a block per 8 columns
    assert small_m_qmm.vector_grid(w, 8, persistent_blocks=7) == (32, 7, True)
    assert small_m_qmm.vector_grid(w, 8, persistent_blocks=125) == (32, 125, False)  # no fewer: the plain form
    assert small_m_qmm.vector_grid(w, 4, persistent_blocks=0) == (32, 250, False)
    wide = mx.zeros((64, 25600 * 4 // 32), mx.uint32)  # down_proj's K: 800 vectors, passes of 256 threads
    assert small_m_qmm.vector_grid(wide, 8, persistent_blocks=3) == (256, 3, True)


@needs_cuda
@pytest.mark.parametrize("bits", small_m_qmm.BITS)
@pytest.mark.parametrize("dtype", small_m_qmm.MMA_DTYPES)
def test_cuda_vector_layouts_persistent_form_gives_the_same_outputs_bit_for_bit(bits, dtype):
    """Fewer blocks striding over the column blocks, the next pass's loads ahead of this one's
    arithmetic: each thread's sums in the same order, so the same outputs bit for bit, over
    one pass a column block (K = 1,024) and several (K = 9,216: 288 vectors at 4-bit, two
    passes of 256 threads), column blocks part empty (999 columns) and blocks that take
    one column block or several."""
    for K in (1024, 9216):
        for rows in (1, 3, 6):
            x, w, scales, biases, _ = small_m_qmm.probe_case(rows, bits, N=999, K=K, dtype=dtype)
            plain = small_m_qmm.small_m_matmul(x, w, scales, biases, bits, layout="vector", persistent_blocks=0)
            for rows_per_block, blocks in ((8, 1), (8, 7), (4, 100), (8, 124)):
                persistent = small_m_qmm.small_m_matmul(x, w, scales, biases, bits, layout="vector",
                                                        rows_per_warp=rows_per_block, persistent_blocks=blocks)
                if rows_per_block == small_m_qmm.VECTOR_ROWS:
                    assert mx.array_equal(persistent, plain).item(), (K, rows, rows_per_block, blocks)
                else:  # another block height: its own plain form is the one to equal
                    own = small_m_qmm.small_m_matmul(x, w, scales, biases, bits, layout="vector",
                                                     rows_per_warp=rows_per_block, persistent_blocks=0)
                    assert mx.array_equal(persistent, own).item(), (K, rows, rows_per_block, blocks)


@needs_cuda
@pytest.mark.parametrize("bits", small_m_qmm.BITS)
@pytest.mark.parametrize("dtype", small_m_qmm.MMA_DTYPES)
@pytest.mark.parametrize("stages", [0, small_m_qmm.MMA_STAGES])
def test_cuda_mma_layout_with_its_constants_hoisted_gives_the_same_outputs_bit_for_bit(bits, dtype, stages):
    for rows in (1, 3, 8, 9, 32):
        x, w, scales, biases, _ = small_m_qmm.probe_case(rows, bits, N=999, K=1024, dtype=dtype)
        hoisted, plain = (small_m_qmm.small_m_matmul(x, w, scales, biases, bits, layout="mma", stages=stages,
                                                     hoist=hoist) for hoist in (True, False))
        assert mx.array_equal(hoisted, plain).item()


@needs_cuda
@pytest.mark.parametrize("bits", small_m_qmm.BITS)
@pytest.mark.parametrize("unroll", [2, 4])
def test_cuda_unrolled_vector_layout_matches_the_float32_truth_at_one_row(bits, unroll):
    for N, K in ((320, 512), (2560, 2560), (999, 1024)):
        x, w, scales, biases, truth = small_m_qmm.probe_case(1, bits, N=N, K=K)
        got = small_m_qmm.small_m_matmul(x, w, scales, biases, bits, layout="vector", unroll=unroll)
        assert small_m_qmm.relative_error(got, truth) < 0.01


@needs_cuda
@pytest.mark.parametrize("bits", small_m_qmm.BITS)
def test_cuda_mma_layout_matches_the_float32_truth_in_float16_and_at_every_block_shape(bits):
    """The tensor-core layout's other input type (its offset is 1024 there, not 128) and the
    block shapes the micro-bench times: warps splitting K, groups loaded before use, and rows
    past one block's 32 (grid y)."""
    for N, K in ((320, 512), (999, 1024)):
        for rows in (1, 7, 8, 9, 33):
            x, w, scales, biases, truth = small_m_qmm.probe_case(rows, bits, N=N, K=K, dtype=mx.float16)
            got = small_m_qmm.small_m_matmul(x, w, scales, biases, bits, layout="mma")
            assert got.dtype == mx.float16 and small_m_qmm.relative_error(got, truth) < 0.01
        x, w, scales, biases, truth = small_m_qmm.probe_case(6, bits, N=N, K=K)
        for warps in (1, 4, 16):
            for groups_per_load in (1, 3):
                got = small_m_qmm.small_m_matmul(x, w, scales, biases, bits, layout="mma", warps=warps,
                                                 unroll=groups_per_load)
                assert small_m_qmm.relative_error(got, truth) < 0.01


@needs_cuda
@pytest.mark.parametrize("bits", small_m_qmm.BITS)
@pytest.mark.parametrize("dtype", small_m_qmm.MMA_DTYPES)
def test_cuda_mma_layout_is_row_invariant(bits, dtype):
    """What row-invariant routing stands on: each row of a 2..MAX_ROWS-row product through the
    tensor cores equals, bit for bit, the product of that row alone (one compiled instance, one
    8-row tile; a tensor core's output element depends on its own row of inputs only)."""
    for N, K in ((320, 512), (999, 1024), (1024, 5120)):
        x, w, scales, biases, _ = small_m_qmm.probe_case(small_m_qmm.MAX_ROWS, bits, N=N, K=K, dtype=dtype)
        alone = [small_m_qmm.small_m_matmul(x[i:i + 1], w, scales, biases, bits, layout="mma")
                 for i in range(small_m_qmm.MAX_ROWS)]
        for rows in range(2, small_m_qmm.MAX_ROWS + 1):
            together = small_m_qmm.small_m_matmul(x[:rows], w, scales, biases, bits, layout="mma")
            assert all(mx.array_equal(together[i:i + 1], alone[i]).item() for i in range(rows)), (N, K, rows)



@needs_cuda
@pytest.mark.parametrize("bits", small_m_qmm.BITS)
@pytest.mark.parametrize("dtype", small_m_qmm.MMA_DTYPES)
def test_cuda_pipelined_mma_layout_equals_the_plain_one_bit_for_bit(bits, dtype):
    """The pipelined form (shared-memory stages, few registers) does the plain layout's
    arithmetic in its order, so it may replace it without moving an output by a bit; a shape
    it does not fit (9 groups, no whole batch of 4) runs the plain layout."""
    configs = ((small_m_qmm.MMA_WARPS, small_m_qmm.MMA_GROUPS_PER_LOAD[bits], 8), (4, 4, 4), (8, 2, 3), (16, 2, 2))
    for N, K in ((320, 512), (999, 1024), (1024, 5120), (320, 576)):
        for rows in (1, 2, 5, 7, 9, 33):
            x, w, scales, biases, truth = small_m_qmm.probe_case(rows, bits, N=N, K=K, dtype=dtype)
            for warps, loads, stages in configs:
                def product(stages, warps=warps, loads=loads):
                    return small_m_qmm.small_m_matmul(x, w, scales, biases, bits, layout="mma", warps=warps,
                                                      unroll=loads, stages=stages)
                pipelined = product(stages)
                assert mx.array_equal(pipelined, product(0)).item(), (N, K, rows, warps, loads, stages)
                assert small_m_qmm.relative_error(pipelined, truth) < 0.01


def test_the_pipelined_mma_layout_runs_the_most_stages_that_fit():
    """A warp's stage holds its 16 weight rows' groups of a batch and their scales and biases
    (4-bit, 4 groups: 2,048 + 256 bytes); a block's stages fit 48 KiB of shared memory, a
    row's scales of a batch must be one 4-, 8- or 16-byte copy, and a matrix's groups whole
    batches. Anything else runs the plain layout (0)."""
    fits = small_m_qmm.pipelined_stages
    assert fits(4, 8, 4, 80, 8) == 2  # 8 warps x 2 x 2,304 = 36,864 bytes; 3 stages pass 48 KiB
    assert fits(4, 4, 4, 80, 8) == 5 and fits(4, 4, 4, 80, 3) == 3
    assert fits(8, 8, 2, 80, 8) == 2  # 8-bit: 2 x 16 rows x 64 bytes + 128
    assert fits(8, 8, 4, 80, 8) == 0  # one stage of 8 warps fits, two do not
    assert fits(4, 8, 4, 81, 8) == 0  # 81 groups: no whole batches of 4
    assert fits(4, 8, 1, 80, 8) == 0 and fits(4, 8, 3, 81, 8) == 0  # 2- or 6-byte scales: no single copy
    assert fits(4, 8, 4, 80, 1) == 0 and fits(4, 8, 4, 80, 0) == 0
    # 16 warps with 5 row tiles asked an H100 for more registers than an SM has (the launch
    # failed; MMA_WARPS_ANY_REGISTERS); 16 warps of 2 groups would fit shared memory.
    assert fits(4, 16, 2, 80, 2) == 0 and fits(4, 8, 2, 80, 2) == 2
    assert small_m_qmm.MMA_STAGES == 2  # served: the shipped 8 x 4 takes 2 stages (above)

@needs_cuda
def test_cuda_row_invariant_routing_keeps_greedy_mtp_equal_to_ar():
    """The dense tiny model, every linear layer 4-bit (its widths are whole groups of 64), under
    256 cached keys (where MLX's decode attention and the verify's buffer attention round
    alike): with every 1..7-row product on the tensor cores, no divergence at all. (The tiny
    hybrid's key width is outside the GDN kernels' domain, whose fallbacks round a verify row
    apart from a decode step: the 27B hybrid is measured by `PART=row-invariant`.)"""
    from mtplxd.engine.bench import real_size
    from mtplxd.engine.model.trunk import Trunk

    model, spec = real_size.build_model("tiny", "4bit")
    assert small_m_qmm.install(model, force=True, row_invariant=True) > 0
    trunk = Trunk(model, spec)
    prompt = mx.random.randint(0, trunk.text.args.vocab_size, (32,), key=mx.random.key(3)).tolist()
    report = real_size.greedy_divergence(trunk, model.mtp, prompt, 3, 48)
    assert report["identical"], report["divergences"][:3]


def _row_invariant_layer(out_dims: int, in_dims: int, bits: int) -> nn.QuantizedLinear:
    layer = nn.QuantizedLinear(in_dims, out_dims, group_size=64, bits=bits)
    layer.__class__ = small_m_qmm.SmallMQuantizedLinear
    layer.row_invariant = True
    return layer


@pytest.mark.parametrize("bits", small_m_qmm.BITS)
def test_row_invariant_routing_sends_every_few_row_product_to_the_tensor_cores(monkeypatch, bits):
    """Decode steps and verify blocks of every matrix, small ones included, take one layout, so
    a verify row rounds as the decode step of that row; float32 inputs (no mma) and a GPU whose
    mma probe failed keep the row-count routing; prefill-sized blocks keep MLX's tiled qmm."""
    monkeypatch.setattr(small_m_qmm, "_mma_usable", True)
    layer = _row_invariant_layer(192, 128, bits)  # far below VERIFY_VECTOR_VALUES
    for dtype in small_m_qmm.MMA_DTYPES:
        layouts = {rows: small_m_qmm.route(mx.zeros((rows, 128), dtype), layer) for rows in range(1, 12)}
        assert layouts == {**{rows: "mma" for rows in range(1, small_m_qmm.MAX_ROWS + 1)},
                           **{rows: None for rows in range(small_m_qmm.MLX_TILED_ROWS, 12)}}
        assert small_m_qmm.route(mx.zeros((1, 1, 128), dtype), layer) == "mma"  # (batch, 1 token, K)
    served = nn.QuantizedLinear(128, 192, group_size=64, bits=bits)
    for rows in range(1, 12):
        x = mx.zeros((rows, 128), mx.float32)
        assert small_m_qmm.route(x, layer) == small_m_qmm.route(x, served)
    monkeypatch.setattr(small_m_qmm, "_mma_usable", False)
    for rows in range(1, 12):
        x = mx.zeros((rows, 128), mx.bfloat16)
        assert small_m_qmm.route(x, layer) == small_m_qmm.route(x, served)


def test_row_invariant_install_takes_the_environment_and_status_says_so(tiny_model_factory, monkeypatch):
    """MTPLX_ROW_INVARIANT=1 asks for the kernel on any quantized model (the tiny one is far from
    the 27B/32B class it serves by default), marks every layer, and /health's kernel entry says
    so; `row_invariant` and `force` given to install decide over the environment."""
    monkeypatch.setattr(small_m_qmm, "_usable", True)
    monkeypatch.setattr(small_m_qmm, "_mma_usable", True)
    path = tiny_model_factory("qwen3", quantize_bits=4)

    def loaded():
        return load_model(path, dequantize_weights="off", compute="checkpoint")

    model = loaded()
    assert not small_m_qmm.row_invariant_wanted()
    assert not model.info.kernels["quantized_matmul"].startswith("small-M")  # not 27B/32B-class
    monkeypatch.setenv(small_m_qmm.ROW_INVARIANT_ENV, "1")
    model = loaded()
    layers = [m for _, m in model.model.named_modules() if isinstance(m, small_m_qmm.SmallMQuantizedLinear)]
    assert layers and all(m.row_invariant for m in layers)
    assert model.info.kernels["quantized_matmul"] == (
        f"small-M CUDA kernel, row-invariant (1..{small_m_qmm.MAX_ROWS} rows on the tensor cores, "
        "pipelined in 2 stages, decode steps included)")
    monkeypatch.delenv(small_m_qmm.ROW_INVARIANT_ENV)
    assert small_m_qmm.install(loaded().model, row_invariant=True) > 0  # asking for it asks for the kernel
    assert small_m_qmm.install(loaded().model, force=False, row_invariant=True) == 0
    plain = loaded().model
    assert small_m_qmm.install(plain, force=True, row_invariant=False) > 0
    assert not any(m.row_invariant for _, m in plain.named_modules()
                   if isinstance(m, small_m_qmm.SmallMQuantizedLinear))
    monkeypatch.setattr(small_m_qmm, "_mma_usable", False)  # no tensor cores: the served routing, said so
    assert "row-invariant" not in small_m_qmm.path_name(len(layers), row_invariant=True)


@pytest.mark.parametrize("family, quantize, everywhere", [
    ("qwen3_5", "4bit", True),  # a hybrid: measured exact and as fast (H200)
    ("qwen3_5", "8bit", True),  # cycles cheaper, decode level, exact over 300 tokens (H100)
    ("qwen3", "4bit", False),  # dense 4-bit: its AR decode as fast mixed, its cycles row-invariant
    ("qwen3", "8bit", True),  # dense 8-bit: its AR decode faster on the mma layout, compiled (H100)
])
def test_the_routing_a_model_loads_with_and_the_environment_decides_over_it(
        tiny_model_factory, monkeypatch, family, quantize, everywhere):
    """Unless MTPLX_ROW_INVARIANT says "1" or "0", a hybrid or a dense 8-bit model that the
    kernel serves (27B/32B-class matrices: here the tiny model's, the threshold lowered) loads
    row-invariant everywhere, a dense 4-bit model row-invariant inside its MTP cycles only,
    and /health says which; "1" routes
    every model row-invariantly everywhere, "0" nowhere."""
    monkeypatch.setattr(small_m_qmm, "_usable", True)
    monkeypatch.setattr(small_m_qmm, "_mma_usable", True)
    monkeypatch.setattr(small_m_qmm, "VERIFY_VECTOR_VALUES", 0)  # every matrix "27B-class"
    path = tiny_model_factory(family, torch_dtype="bfloat16")

    def routing(model):
        layers = [m for _, m in model.model.named_modules() if isinstance(m, small_m_qmm.SmallMQuantizedLinear)]
        assert layers  # the kernel is installed either way
        assert len({(m.row_invariant, m.cycle_row_invariant) for m in layers}) == 1
        said = model.info.kernels["quantized_matmul"]
        if layers[0].row_invariant:
            assert said.startswith("small-M CUDA kernel, row-invariant (")
            return "everywhere"
        if layers[0].cycle_row_invariant:
            assert said.startswith("small-M CUDA kernel, row-invariant in MTP cycles (")
            return "cycles"
        assert "row-invariant" not in said
        return "nowhere"

    def loaded():
        return load_model(path, quantize=quantize, dequantize_weights="off", compute="checkpoint")

    assert routing(loaded()) == ("everywhere" if everywhere else "cycles")
    for asked, want in (("1", "everywhere"), ("0", "nowhere")):
        monkeypatch.setenv(small_m_qmm.ROW_INVARIANT_ENV, asked)
        assert routing(loaded()) == want
    assert not small_m_qmm.row_invariant_wanted() and not small_m_qmm.cycle_row_invariant_wanted()


def test_cycle_routing_marks_each_resume_of_an_mtp_loop_and_nothing_between(monkeypatch):
    """The scheduler steps other requests between one request's cycles: only the cycle's own
    resumes (sends and the closing write-back included) run as an MTP cycle."""
    seen = []

    def loop():
        try:
            while True:
                got = yield small_m_qmm.in_mtp_cycle()
                seen.append(("sent", got, small_m_qmm.in_mtp_cycle()))
        finally:
            seen.append(("closed", small_m_qmm.in_mtp_cycle()))

    cycles = small_m_qmm.cycle_routed(loop())
    assert next(cycles) is True and not small_m_qmm.in_mtp_cycle()
    assert cycles.send("answer") is True and not small_m_qmm.in_mtp_cycle()
    cycles.close()
    assert seen == [("sent", "answer", True), ("closed", True)] and not small_m_qmm.in_mtp_cycle()

    def finite():
        yield 1
        return "done"

    cycles = small_m_qmm.cycle_routed(finite())
    assert next(cycles) == 1
    with pytest.raises(StopIteration) as stop:
        next(cycles)
    assert stop.value.value == "done" and not small_m_qmm.in_mtp_cycle()


@pytest.mark.parametrize("loop", ["fused", "stepwise"])
def test_a_dense_model_routes_its_mtp_cycles_row_invariant_and_its_ar_steps_mixed(
        tiny_model_factory, monkeypatch, small_m_kernel_twin, loop):
    """A dense 4-bit model in bfloat16 that the kernel serves (threshold lowered), through the
    kernel's plain-ops twin: an AR request's 1-row products keep the mixed routing (the vector
    layout, never the tensor cores), an MTP request's cycles put every 1..MAX_ROWS-row product
    on the tensor-core layout (the head's 1-row drafts included), and greedy MTP equals AR."""
    calls, twin, in_cycles = small_m_kernel_twin, small_m_qmm.small_m_matmul, []

    def recording(x, w, scales, biases, bits, layout=None):
        if small_m_qmm.in_mtp_cycle():
            in_cycles.append((x.size // x.shape[-1], layout))
        return twin(x, w, scales, biases, bits, layout=layout)

    monkeypatch.setattr(small_m_qmm, "small_m_matmul", recording)
    monkeypatch.setattr(small_m_qmm, "VERIFY_VECTOR_VALUES", 0)
    monkeypatch.setattr(small_m_qmm, "LARGE_MATRIX_VALUES", 0)
    model = load_model(tiny_model_factory("qwen3", torch_dtype="bfloat16"), quantize="4bit",
                       dequantize_weights="off", compute="checkpoint", decode_loop=loop)
    assert "row-invariant in MTP cycles" in model.info.kernels["quantized_matmul"]
    ids = model.tokenizer.encode("def add(a, b):")

    def run(depth):
        calls.clear(), in_cycles.clear()
        request = GenerationRequest(ids, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), depth=depth)
        return model.complete(request).token_ids

    ar = run(0)
    assert not in_cycles and {layout for rows, layout in calls if rows == 1} == {"vector"}  # mixed
    assert run(3) == ar
    assert {layout for _, layout in in_cycles} == {"mma"}
    assert {1, 4} <= {rows for rows, _ in in_cycles}  # the head's drafts, depth 3's verify


def test_row_invariant_routing_keeps_greedy_mtp_equal_to_ar_through_the_kernels_twin(
        tiny_model_factory, monkeypatch, small_m_kernel_twin):
    """A hybrid in bfloat16 (a GPU's activations) with every 1..MAX_ROWS-row product on the
    tensor-core layout, here its plain-ops twin: decode steps and verify blocks all take it,
    and greedy MTP equals AR."""
    calls = small_m_kernel_twin
    monkeypatch.setenv(small_m_qmm.ROW_INVARIANT_ENV, "1")
    model = load_model(tiny_model_factory("qwen3_5", torch_dtype="bfloat16"), quantize="4bit",
                       dequantize_weights="off", compute="checkpoint")
    ids = model.tokenizer.encode("def add(a, b):")

    def run(depth):
        request = GenerationRequest(ids, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), depth=depth)
        return model.complete(request).token_ids

    assert run(0) == run(3)
    assert {layout for _, layout in calls} == {"mma"}
    assert {1, 4} <= {rows for rows, _ in calls}  # AR's decode steps and depth 3's verify blocks


@pytest.mark.parametrize("layout", ["word", "vector", "mma"])
@pytest.mark.parametrize("shape,reshaped", [((1, 1, 128), False), ((3, 1, 128), False), ((2, 128), False),
                                            ((1, 4, 128), True), ((2, 3, 128), True), ((128,), True)])
def test_the_kernel_takes_rows_without_a_reshape_where_the_first_dimension_counts_them(
        monkeypatch, layout, shape, reshaped):
    """A decode step's (1, 1, K) goes to the kernel as it is and the kernel writes the
    caller's (1, 1, N): no reshape primitive on either side (the host builds every primitive
    of an op-by-op step). Other shapes reshape the input to (M, K) only. The kernel is what
    this machine lacks: a stand-in records what it is given and returns zeros."""
    given = []

    def kernel(*, inputs, output_shapes, output_dtypes, grid, **_):
        given.append((inputs[0], output_shapes[0], grid))
        return [mx.zeros(output_shapes[0], output_dtypes[0])]

    monkeypatch.setattr(small_m_qmm, "_small_m_kernel", lambda name: kernel)
    _, w, scales, biases, _ = small_m_qmm.probe_case(2, 4, N=64, K=128, dtype=mx.bfloat16)
    x = mx.ones(shape, mx.bfloat16)
    out = small_m_qmm.small_m_matmul(x, w, scales, biases, 4, layout=layout)
    (rows, out_shape, grid), = given
    assert out.shape == out_shape == (*shape[:-1], 64)
    assert (rows is not x) == reshaped and rows.size == x.size and rows.shape[0] * 128 == x.size
    assert grid[1] >= 1


@pytest.mark.parametrize("warps,tiles", [(8, 4), (4, 4), (16, 1)])
def test_a_block_of_more_warps_than_fit_any_register_count_takes_one_row_tile(monkeypatch, warps, tiles):
    """33 rows: four 8-row tiles a block (two blocks down grid y) at up to 8 warps; a block of
    16 warps (512 threads, at most 128 registers each) takes one tile, five blocks down (4
    tiles of the plain layout at 8-bit needed 134 registers and failed to launch on an H100)."""
    given = []

    def kernel(*, template, grid, threadgroup, output_shapes, output_dtypes, **_):
        given.append((dict(template), grid, threadgroup))
        return [mx.zeros(output_shapes[0], output_dtypes[0])]

    monkeypatch.setattr(small_m_qmm, "_small_m_kernel", lambda name: kernel)
    x, w, scales, biases, _ = small_m_qmm.probe_case(33, 8, N=64, K=512, dtype=mx.bfloat16)
    small_m_qmm.small_m_matmul(x, w, scales, biases, 8, layout="mma", warps=warps, unroll=2, stages=0)
    (template, grid, threadgroup), = given
    assert template["MT"] == tiles and template["KW"] == warps and threadgroup == (32 * warps, 1, 1)
    assert grid[1] == -(-33 // (8 * tiles))


def test_the_mma_layout_takes_16_bit_inputs_only():
    x, w, scales, biases, _ = small_m_qmm.probe_case(2, 4, N=64, K=128, dtype=mx.float32)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        small_m_qmm.small_m_matmul(x, w, scales, biases, 4, layout="mma")


@needs_cuda
def test_cuda_greedy_mtp_equals_ar_with_the_kernel(tiny_model_factory):
    model = load_model(tiny_model_factory("qwen3", head_dim=64), quantize="4bit")
    assert small_m_qmm.install(model.model, force=True) > 0
    ids = model.tokenizer.encode("def add(a, b):")

    def run(depth):
        request = GenerationRequest(ids, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True), depth=depth)
        return model.complete(request).token_ids

    assert run(3) == run(0)


def test_installed_layers_route_few_rows_to_the_kernel_and_the_rest_to_mlx(tiny_model_factory, monkeypatch):
    """The routing, on this CPU: the GPU is what this machine lacks, so the kernel's plain-ops
    twin (`reference`) stands in for it; prefill-sized inputs must still go to MLX."""
    calls = []

    def kernel_twin(x, w, scales, biases, bits, layout=None):
        assert layout == "word"  # these small matrices are below LARGE_MATRIX_VALUES
        calls.append(x.size // x.shape[-1])
        return small_m_qmm.reference(x, w, scales, biases, bits)

    monkeypatch.setattr(small_m_qmm, "_usable", True)
    monkeypatch.setattr(small_m_qmm, "_mma_usable", None)  # install probes it; put back after
    monkeypatch.setattr(small_m_qmm, "small_m_matmul", kernel_twin)
    model = load_model(tiny_model_factory("qwen3"), quantize="8bit")  # groups of 64 where they fit
    ids = model.tokenizer.encode("def add(a, b):\n    return a" + " + b" * 40)

    def run(depth):
        request = GenerationRequest(ids, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), depth=depth)
        return model.complete(request).token_ids

    stock = run(3)
    switched = small_m_qmm.install(model.model, force=True)
    assert switched > 0 and small_m_qmm.path_name(switched).startswith("small-M CUDA kernel")
    model.trunk.compiled_graphs.clear()  # trace the fused cycle again, through the new layers
    assert run(0) == run(3)  # greedy MTP = AR with the kernel's arithmetic
    assert calls and max(calls) <= small_m_qmm.MAX_ROWS  # the prompt (len(ids) rows) went to MLX
    assert min(calls) >= small_m_qmm.MIN_ROWS[8]  # and the 1-row decode steps too
    assert len(ids) > small_m_qmm.MAX_ROWS
    assert len(stock) == 24


def test_decode_rows_of_large_matrices_take_the_vector_layout(tiny_model_factory, monkeypatch):
    """A decode step's product (under MIN_ROWS rows) of a 4-bit model goes to the vector layout
    only on a matrix of LARGE_MATRIX_VALUES weights or more; here every matrix counts as large,
    and greedy MTP still equals AR through the plain-ops twin. An 8-bit model's stay on MLX."""
    layouts = []

    def kernel_twin(x, w, scales, biases, bits, layout=None):
        layouts.append((x.size // x.shape[-1], layout))
        return small_m_qmm.reference(x, w, scales, biases, bits)

    monkeypatch.setattr(small_m_qmm, "_usable", True)
    monkeypatch.setattr(small_m_qmm, "_mma_usable", None)  # install probes it; put back after
    monkeypatch.setattr(small_m_qmm, "small_m_matmul", kernel_twin)
    monkeypatch.setattr(small_m_qmm, "LARGE_MATRIX_VALUES", 0)
    eight_bit = load_model(tiny_model_factory("qwen3"), quantize="8bit")
    assert small_m_qmm.install(eight_bit.model, force=True) > 0
    assert not any(getattr(m, "kernel_decode", True) for _, m in eight_bit.model.named_modules()
                   if isinstance(m, small_m_qmm.SmallMQuantizedLinear))
    model = load_model(tiny_model_factory("qwen3"), quantize="4bit", small_m_kernel=False)  # installed below
    assert small_m_qmm.install(model.model, force=True) > 0
    ids = model.tokenizer.encode("def add(a, b):")

    def run(depth):
        request = GenerationRequest(ids, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), depth=depth)
        return model.complete(request).token_ids

    assert run(0) == run(3)
    assert {layout for rows, layout in layouts if rows < small_m_qmm.MIN_ROWS[4]} == {"vector"}
    assert {layout for rows, layout in layouts if rows >= small_m_qmm.MIN_ROWS[4]} == {"word"}


def test_a_hybrid_models_layers_keep_decode_steps_on_mlx(monkeypatch):
    """In the mixed routing (a hybrid's at 8-bit, or with MTPLX_ROW_INVARIANT=0) install marks a
    hybrid model's layers so that their decode steps stay on MLX's matvec while their verify
    blocks take the kernel; `decode` decides otherwise."""
    from mtplxd.engine.bench import real_size

    monkeypatch.setattr(small_m_qmm, "_usable", True)
    monkeypatch.setattr(small_m_qmm, "_mma_usable", True)
    monkeypatch.setattr(small_m_qmm, "LARGE_MATRIX_VALUES", 0)  # every matrix counts as large
    monkeypatch.setattr(small_m_qmm, "VERIFY_VECTOR_VALUES", 0)
    hybrid, _ = real_size.build_model("tiny-hybrid", "4bit")
    assert small_m_qmm.install(hybrid, force=True, row_invariant=False) > 0
    layer = next(m for _, m in hybrid.named_modules() if isinstance(m, small_m_qmm.SmallMQuantizedLinear))
    K = layer["weight"].shape[1] * 32 // layer.bits
    assert small_m_qmm.route(mx.zeros((1, K), mx.bfloat16), layer) is None
    assert small_m_qmm.route(mx.zeros((4, K), mx.bfloat16), layer) == "mma"
    dense = nn.Sequential(_quantized(8192, 5120, 4))
    assert small_m_qmm.install(dense) == 1
    assert small_m_qmm.route(mx.zeros((1, 5120), mx.bfloat16), dense.layers[0]) == "vector"
    again, _ = real_size.build_model("tiny-hybrid", "4bit")
    small_m_qmm.install(again, force=True, decode=True, row_invariant=False)
    layer = next(m for _, m in again.named_modules() if isinstance(m, small_m_qmm.SmallMQuantizedLinear))
    assert small_m_qmm.route(mx.zeros((1, K), mx.bfloat16), layer) == "vector"


def test_a_hybrid_models_verify_blocks_take_the_kernel_and_its_decode_steps_do_not(tiny_model_factory, monkeypatch):
    """The mixed routing on CUDA (an 8-bit hybrid's; a 4-bit one's with MTPLX_ROW_INVARIANT=0),
    every matrix counted as large: the hybrid's verify blocks go through the kernel, its 1-row
    steps through MLX, and greedy MTP still equals AR through the plain-ops twin."""
    calls = []

    def kernel_twin(x, w, scales, biases, bits, layout=None):
        calls.append((x.size // x.shape[-1], layout, x.dtype))
        return small_m_qmm.reference(x, w, scales, biases, bits)

    monkeypatch.setattr(small_m_qmm, "_usable", True)
    monkeypatch.setattr(small_m_qmm, "_mma_usable", True)
    monkeypatch.setattr(small_m_qmm, "small_m_matmul", kernel_twin)
    monkeypatch.setattr(small_m_qmm, "LARGE_MATRIX_VALUES", 0)
    monkeypatch.setattr(small_m_qmm, "VERIFY_VECTOR_VALUES", 0)
    monkeypatch.setenv(small_m_qmm.ROW_INVARIANT_ENV, "0")
    model = load_model(tiny_model_factory("qwen3_5"), quantize="4bit")  # installs it by default here
    assert model.info.kernels["quantized_matmul"].startswith("small-M CUDA kernel")
    assert model.info.kernels["quantized_matmul"].endswith("decode steps on mlx)")
    assert any(isinstance(m, small_m_qmm.SmallMQuantizedLinear) for _, m in model.model.named_modules())
    ids = model.tokenizer.encode("def add(a, b):")

    def run(depth):
        request = GenerationRequest(ids, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), depth=depth)
        return model.complete(request).token_ids

    assert run(0) == run(3)
    # No 1-row step; 16-bit activations (a GPU's) take the tensor cores from 2 rows, float32
    # ones (this CPU's) the vector layout from MIN_ROWS.
    assert calls and min(rows for rows, _, _ in calls) >= 2
    assert all(layout == "mma" if dtype in small_m_qmm.MMA_DTYPES
               else layout == "vector" and rows >= small_m_qmm.MIN_ROWS[4]
               for rows, layout, dtype in calls if rows <= small_m_qmm.VECTOR_MAX_ROWS[4])


def test_route_keeps_small_matrices_decode_on_mlx():


    layer = nn.QuantizedLinear(128, 192, group_size=64, bits=4)
    assert small_m_qmm.route(mx.zeros((1, 128)), layer) is None  # 1 row of a small matrix: MLX
    assert small_m_qmm.route(mx.zeros((small_m_qmm.MIN_ROWS[4], 128)), layer) == "word"
    assert small_m_qmm.route(mx.zeros((small_m_qmm.MAX_ROWS + 1, 128)), layer) is None  # prefill


def test_route_sends_short_verify_blocks_of_large_matrices_to_the_tensor_cores(monkeypatch):
    """16-bit inputs (every served model's) take the mma layout there, float32 inputs the
    vector layout up to VECTOR_MAX_ROWS; from MLX_TILED_ROWS rows MLX's tiled qmm, decode
    steps of this matrix MLX."""
    layer = nn.QuantizedLinear(128, 192, group_size=64, bits=8)
    monkeypatch.setattr(small_m_qmm, "_mma_usable", True)
    monkeypatch.setattr(small_m_qmm, "VERIFY_VECTOR_VALUES", 128 * 192)  # this matrix counts as large
    monkeypatch.setattr(small_m_qmm, "LARGE_MATRIX_VALUES", 10**9)  # its decode steps do not
    for dtype in (mx.bfloat16, mx.float16):  # from 2 rows, where MLX's matvec already costs 2x
        layouts = {rows: small_m_qmm.route(mx.zeros((rows, 128), dtype), layer) for rows in range(1, 12)}
        assert layouts == {1: None, 2: "mma", 3: "mma", 4: "mma", 5: "mma", 6: "mma", 7: "mma",
                           8: None, 9: None, 10: None, 11: None}
    layouts = {rows: small_m_qmm.route(mx.zeros((rows, 128), mx.float32), layer) for rows in range(1, 12)}
    assert layouts == {1: None, 2: None, 3: None, 4: "vector", 5: "vector", 6: "vector", 7: "vector",
                       8: None, 9: None, 10: None, 11: None}
    four_bit = nn.QuantizedLinear(128, 192, group_size=64, bits=4)
    assert [small_m_qmm.route(mx.zeros((rows, 128), mx.bfloat16), four_bit) for rows in (2, 3, 6, 7, 8)] == [
        "mma", "mma", "mma", "mma", None]
    assert [small_m_qmm.route(mx.zeros((rows, 128)), four_bit) for rows in (3, 6, 7)] == ["vector", "vector", "word"]
    assert "2..7 on the tensor cores, pipelined in 2 stages" in small_m_qmm.path_name(1)  # what /health says
    # A GPU where the tensor-core layout failed its probe keeps the vector layout there.
    monkeypatch.setattr(small_m_qmm, "_mma_usable", False)
    assert small_m_qmm.route(mx.zeros((4, 128), mx.bfloat16), layer) == "vector"
    assert small_m_qmm.route(mx.zeros((2, 128), mx.bfloat16), layer) is None
    assert "tensor cores" not in small_m_qmm.path_name(1)


def test_decode_steps_of_the_largest_matrices_take_the_tensor_cores_when_asked(monkeypatch):
    """DECODE_MMA_VALUES (opt-in): a 1-row product of 16-bit inputs on a matrix of that many
    weights goes to the mma layout instead of the vector layout; smaller large matrices, float32
    inputs and a GPU whose mma layout failed its probe keep the vector layout; /health says so."""
    big, mid = (nn.QuantizedLinear(128, n, group_size=64, bits=4) for n in (256, 192))
    monkeypatch.setattr(small_m_qmm, "_mma_usable", True)
    monkeypatch.setattr(small_m_qmm, "LARGE_MATRIX_VALUES", 128 * 192)
    one_row = mx.zeros((1, 1, 128), mx.bfloat16)
    assert small_m_qmm.route(one_row, big) == small_m_qmm.route(one_row, mid) == "vector"  # served
    assert "decode steps of large matrices on the vector layout)" in small_m_qmm.path_name(1)
    monkeypatch.setattr(small_m_qmm, "DECODE_MMA_VALUES", 128 * 256)
    assert small_m_qmm.route(one_row, big) == "mma" and small_m_qmm.route(one_row, mid) == "vector"
    assert small_m_qmm.route(mx.zeros((1, 128), mx.float32), big) == "vector"
    assert "the vector layout, from 0.03125M weights on the tensor cores" in small_m_qmm.path_name(1)
    monkeypatch.setattr(small_m_qmm, "_mma_usable", False)
    assert small_m_qmm.route(one_row, big) == "vector"
    assert "tensor cores" not in small_m_qmm.path_name(1)
    # The vector layout's persistent form (opt-in) is named where it serves.
    monkeypatch.setattr(small_m_qmm, "VECTOR_PERSISTENT_BLOCKS", 264)
    assert "decode steps of large matrices on the vector layout (persistent, 264 blocks))" in small_m_qmm.path_name(1)


def test_a_kernel_probe_that_fails_or_disagrees_keeps_the_fallback(caplog):
    from mtplxd.engine.model import custom_kernels

    def broken():
        raise RuntimeError("nvrtc: no such device")

    assert custom_kernels.probe("test", lambda: 0.001, 0.01, "mlx") is True
    assert custom_kernels.probe("test", lambda: 0.5, 0.01, "mlx") is False
    assert custom_kernels.probe("test", lambda: float("nan"), 0.01, "mlx") is False
    assert custom_kernels.probe("test", broken, 0.01, "mlx") is False
    assert "no such device" in caplog.text and "disagrees" in caplog.text


def test_the_micro_bench_runs_here_and_says_the_kernel_is_not(tmp_path):
    import json

    from mtplxd.engine.bench import small_m

    out = tmp_path / "small-m.json"
    assert small_m.main([str(out), "--sizes", "tiny", "--rows", "1,3", "--bits", "4", "--repeats", "2"]) == 0
    report = json.loads(out.read_text())
    assert report["kernel_usable"] is ON_CUDA
    rows = report["results"]
    assert [(r["matrix"], r["M"]) for r in rows] == [("proj", 1), ("proj", 3), ("lm_head", 1), ("lm_head", 3)]
    for row in rows:
        assert row["mlx_us"] > 0 and row["weight_bytes"] > 0
        if not ON_CUDA:
            assert row["kernel_us"] is None and row["vector_us"] is None and row["mma_us"] is None
            assert row["reference_error"] < 0.02



def test_the_micro_bench_times_the_fewer_instruction_forms_beside_the_served_ones(monkeypatch, tmp_path, capsys):
    """On CUDA each row times the vector layout's three forms and the mma layout hoisted or not,
    and says whether the forms that must keep the bits did (here the kernel is its plain-ops
    twin, nudged where only the bias-once form may move)."""
    from mtplxd.engine.bench import small_m

    seen = set()

    def twin(x, w, scales, biases, bits, *args, in_place=None, bias_once=None, hoist=None, **kwargs):
        seen.add((in_place, bias_once, hoist))
        out = small_m_qmm.reference(x, w, scales, biases, bits)
        return out * (1 + 1e-3) if bias_once else out

    monkeypatch.setattr(small_m_qmm, "usable", lambda: True)
    monkeypatch.setattr(small_m_qmm, "small_m_matmul", twin)
    rows = small_m.measure_shape(64, 256, 4, [1, 2], repeats=1, shipped_only=True)
    for row in rows:
        assert set(row["vector_us_by_form"]) == {"masked", "in_place", "bias_once"}
        assert all(us > 0 for us in row["vector_us_by_form"].values())
        assert row["in_place_equals_masked"] is True and 5e-4 < row["bias_once_error"] < 0.01
        assert set(row["mma_us_by_hoist"]) == {False, True} and row["hoisted_equals_plain"] is True
    assert {(False, False, None), (True, False, None), (True, True, None), (None, None, True),
            (None, None, False)} <= seen
    out = tmp_path / "small-m.json"  # the whole command, its printed line included
    assert small_m.main([str(out), "--sizes", "tiny", "--rows", "1", "--bits", "4", "--repeats", "1",
                         "--shipped-only"]) == 0
    assert "in place same bits True" in capsys.readouterr().out


@pytest.mark.parametrize("pipelined_moves_a_bit", [False, True])
def test_the_micro_bench_times_each_mma_config_and_checks_the_pipelined_form(monkeypatch, pipelined_moves_a_bit):
    """`--mma-variants` on CUDA times the mma layout at every MMA_CONFIGS shape, says which
    stages each pipelined one ran, and whether its outputs equal the plain layout's bit for
    bit (here the kernel is its plain-ops twin, nudged where a pipelined output should move)."""
    from mtplxd.engine.bench import small_m

    seen = set()

    def twin(x, w, scales, biases, bits, layout=None, warps=None, unroll=None, stages=None):
        seen.add((layout, warps, unroll, stages))
        out = small_m_qmm.reference(x, w, scales, biases, bits)
        return out + 1 if pipelined_moves_a_bit and stages else out

    monkeypatch.setattr(small_m_qmm, "small_m_matmul", twin)
    x, w, scales, biases, _ = small_m_qmm.probe_case(1, 4)  # K = 512: 8 groups
    report = small_m._mma_configs_timed(x, w, scales, biases, 4, repeats=1)
    assert report["mma_stages_by_config"] == {"8x4": 0, "8x4s2": 2, "8x2s3": 3, "4x4": 0, "4x4s4": 4, "4x2s4": 4}
    assert set(report["mma_us_by_config"]) == set(report["mma_stages_by_config"])
    assert all(us > 0 for us in report["mma_us_by_config"].values())
    assert report["mma_pipelined_equals_plain"] is not pipelined_moves_a_bit
    assert {("mma", 8, 4, 0), ("mma", 8, 4, 2), ("mma", 4, 2, 4)} <= seen

NVCC = __import__("shutil").which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed here")
def test_the_kernel_source_compiles_for_the_h200(tmp_path):
    """What this machine can check of the CUDA kernel without a GPU: its source, in the
    signature mx.fast.cuda_kernel generates (uint32 weights, `w_shape`, template constants),
    compiles for sm_90 at the smallest and largest row count and both bit widths, without
    spilling registers."""
    import re
    import subprocess

    def kernel(name: str, dtype: str, constants: dict, body: str) -> str:
        """`body` in the signature mx.fast.cuda_kernel generates, with its template constants."""
        lines = "".join(f"  constexpr {'bool' if isinstance(v, bool) else 'int'} {k} = {str(v).lower()};\n"
                        for k, v in constants.items())
        return (f"__global__ void {name}(const {dtype}* x, const __grid_constant__ Shape x_shape, "
                f"const uint32_t* w, const __grid_constant__ Shape w_shape, const {dtype}* scales, "
                f"const {dtype}* biases, {dtype}* out) {{\n  using T = {dtype};\n{lines}{body}\n}}\n")

    dtype = "__nv_bfloat16"
    kernels = []
    # The kernel's M (rows per block) at both ends of what each layout serves: the word
    # layout up to ROW_CHUNK, the vector layout up to VECTOR_MAX_ROWS[bits] (decode steps and
    # short verify blocks).
    # The micro-bench's unrolled vector layout at the decode rows it times: 2 vectors a thread
    # at 1-3 rows, 4 at 1 row (4 spill from 2 rows: 244-255 registers).
    layouts = {"word": (small_m_qmm._SOURCE, small_m_qmm.ROWS_PER_WARP, lambda bits: (1, small_m_qmm.ROW_CHUNK), 1),
               "vector": (small_m_qmm._SOURCE_VECTOR, small_m_qmm.VECTOR_ROWS,
                          lambda bits: (1, small_m_qmm.MIN_ROWS[bits] - 1, small_m_qmm.VECTOR_MAX_ROWS[bits]), 1),
               "vector_u2": (small_m_qmm._SOURCE_VECTOR, small_m_qmm.VECTOR_ROWS,
                             lambda bits: (1, small_m_qmm.MIN_ROWS[bits] - 1), 2),
               "vector_u4": (small_m_qmm._SOURCE_VECTOR, small_m_qmm.VECTOR_ROWS, lambda bits: (1,), 4),
               "vector_in_place": (small_m_qmm._SOURCE_VECTOR, small_m_qmm.VECTOR_ROWS,
                                   lambda bits: (1, small_m_qmm.VECTOR_MAX_ROWS[bits]), 1),
               # The persistent form (VECTOR_PERSISTENT_BLOCKS: one-row products) at the served
               # block height and at 4 rows a block (72 registers at 4-bit: two passes in flight).
               "vector_persistent": (small_m_qmm._SOURCE_VECTOR, small_m_qmm.VECTOR_ROWS, lambda bits: (1,), 1),
               "vector_persistent_r4": (small_m_qmm._SOURCE_VECTOR, 4, lambda bits: (1,), 1)}
    # The tensor-core layout: both input types, one tile and the most a block takes, and the
    # micro-bench's most groups loaded before use (that one with its constants in registers,
    # MMA_HOIST's form).
    for bits in small_m_qmm.BITS:
        for mma_dtype, bf16 in ((dtype, True), ("__half", False)):
            default = small_m_qmm.MMA_GROUPS_PER_LOAD[bits]
            for tiles, loads in ((1, default), (small_m_qmm.MMA_MAX_TILES, default), (1, 8)):
                kernels.append(kernel(
                    f"k_mma_{bf16}_{tiles}_{loads}_{bits}", mma_dtype,
                    {"BF16": bf16, "BITS": bits, "GS": small_m_qmm.GROUP_SIZE, "MT": tiles,
                     "KW": small_m_qmm.MMA_WARPS, "U": loads, "HOIST": loads == 8}, small_m_qmm._SOURCE_MMA))
            # The pipelined form at the most stages that fit, at the shipped block shape and
            # the micro-bench's 4 warps with 4 stages.
            for tiles, warps, loads, asked in ((1, small_m_qmm.MMA_WARPS, default, 8),
                                               (small_m_qmm.MMA_MAX_TILES, 4, 4, 4)):
                stages = small_m_qmm.pipelined_stages(bits, warps, loads, 80, asked)
                assert stages >= 2
                kernels.append(kernel(
                    f"k_mma_pipelined_{bf16}_{tiles}_{warps}_{stages}_{bits}", mma_dtype,
                    {"BF16": bf16, "BITS": bits, "GS": small_m_qmm.GROUP_SIZE, "MT": tiles, "KW": warps,
                     "U": loads, "S": stages, "HOIST": small_m_qmm.MMA_HOIST}, small_m_qmm._SOURCE_MMA_PIPELINED))
    for layout, (body, per_block, row_counts, unroll) in layouts.items():
        for bits in small_m_qmm.BITS:
            for rows in row_counts(bits):
                kernels.append(kernel(
                    f"k_{layout}_{rows}_{bits}", dtype,
                    {"M": rows, "BITS": bits, "GS": small_m_qmm.GROUP_SIZE, "R": per_block, "CONVERT": False,
                     "U": unroll, "IN_PLACE": layout.startswith(("vector_in_place", "vector_persistent")),
                     "BIAS_ONCE": layout == "vector_in_place",
                     "PERSISTENT": layout.startswith("vector_persistent")}, body))
    # MLX's default header gives the body `Shape` and the `cg` alias (mlx/backend/cuda/custom_kernel.cpp).
    source = ("#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n#include <cstdint>\n"
              + custom_kernels.TENSOR_CORE_HEADER + small_m_qmm._HEADER +
              "#include <cooperative_groups.h>\n#include <cuda/std/array>\nnamespace mlx::core::cu {\n"
              "using Shape = cuda::std::array<int32_t, 8>;\nnamespace cg = cooperative_groups;\n"
              + "".join(kernels) + "}\n")
    path = tmp_path / "small_m.cu"
    path.write_text(source)
    done = subprocess.run([NVCC, "-arch=sm_90", "-std=c++17", "-c", str(path), "-o", str(tmp_path / "k.o"),
                           "-Xptxas", "-v"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "error" not in done.stderr.lower()
    assert "spill stores" in done.stderr
    assert all(" 0 bytes spill stores" in line for line in done.stderr.splitlines() if "spill stores" in line)
    # The pipelined mma layout's point: fewer registers than the plain one at the same shape
    # (106 a thread at 4-bit, 4 groups a load, where Nsight put the plain layout's occupancy at 25%).
    used = dict(re.findall(r"Compiling entry function '\w*?(k_\w+?)E.*?Used (\d+) registers", done.stderr, re.S))
    for bits in small_m_qmm.BITS:
        default, stages = small_m_qmm.MMA_GROUPS_PER_LOAD[bits], small_m_qmm.pipelined_stages(
            bits, small_m_qmm.MMA_WARPS, small_m_qmm.MMA_GROUPS_PER_LOAD[bits], 80, 8)
        plain = int(used[f"k_mma_True_1_{default}_{bits}"])
        pipelined = int(used[f"k_mma_pipelined_True_1_{small_m_qmm.MMA_WARPS}_{stages}_{bits}"])
        assert pipelined < plain, (bits, pipelined, plain)


def test_routing_marks_are_walked_once_until_the_routing_changes(tiny_model_factory, monkeypatch):
    """`decode_routed` (asked before every AR request on CUDA) walks the model's modules once
    and remembers the answer on the model, outside its parameters, until the next install or
    uninstall; both change the answer."""
    from mlx.utils import tree_flatten

    monkeypatch.setattr(small_m_qmm, "_usable", True)
    monkeypatch.setattr(small_m_qmm, "_mma_usable", True)
    model = load_model(tiny_model_factory("qwen3", quantize_bits=4), dequantize_weights="off",
                       compute="checkpoint").model
    parameters = [name for name, _ in tree_flatten(model.parameters())]
    walks = []
    walk = model.named_modules
    monkeypatch.setattr(model, "named_modules", lambda: walks.append(1) or walk(), raising=False)
    assert not small_m_qmm.decode_routed(model) and not small_m_qmm.decode_routed(model)
    assert len(walks) <= 1  # none where loading asked already (/health's ar_decode path)
    assert small_m_qmm.install(model, force=True, decode=True) > 0
    walks.clear()
    assert small_m_qmm.decode_routed(model) and small_m_qmm.decode_routed(model)
    assert small_m_qmm.routed_row_invariant(model) is False
    assert len(walks) == 1
    assert small_m_qmm.uninstall(model) > 0
    assert not small_m_qmm.decode_routed(model)
    assert [name for name, _ in tree_flatten(model.parameters())] == parameters
