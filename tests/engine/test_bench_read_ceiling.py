"""bench.read_ceiling: readers of a quantized matrix's bytes that compute nothing, for Nsight
Compute. Their numpy references on any machine; the CUDA kernels against them on a GPU."""

import mlx.core as mx
import numpy as np
import pytest

from mtplxd.engine.bench import read_ceiling
from mtplxd.engine.model.kv_cache import fixed_shapes_wanted

needs_cuda = pytest.mark.skipif(not fixed_shapes_wanted(), reason="the readers are CUDA kernels")


def quantized(n: int, k: int, bits: int, seed: int = 0):
    weight = mx.random.normal((n, k), key=mx.random.key(seed)).astype(mx.bfloat16)
    return mx.quantize(weight, group_size=64, bits=bits)


@pytest.mark.parametrize("bits", [4, 8])
def test_the_vector_reference_xors_each_16_byte_vector_with_its_groups_bits(bits):
    w, scales, biases = quantized(5, 512, bits)
    words = np.array(w)
    scale_bits = np.array(scales.view(mx.uint16)).astype(np.uint32)
    bias_bits = np.array(biases.view(mx.uint16)).astype(np.uint32)
    values_per_vector = 4 * 32 // bits
    want = []
    for n in range(words.shape[0]):  # the kernel's loop, spelled one vector at a time
        acc = 0
        for v in range(words.shape[1] // 4):
            g = v * values_per_vector // 64
            for word in words[n, 4 * v:4 * v + 4]:
                acc ^= int(word)
            acc ^= int(scale_bits[n, g]) | (int(bias_bits[n, g]) << 16)
        want.append(acc)
    assert read_ceiling.reference_vector(w, scales, biases, bits).tolist() == want


def test_the_stream_reference_is_the_xor_of_every_word():
    w, _, _ = quantized(3, 256, 4)
    acc = 0
    for word in np.array(w).ravel():
        acc ^= int(word)
    assert read_ceiling.reference_stream(w) == acc


@needs_cuda
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows_per_block", [2, 8, 16])
def test_cuda_the_vector_reader_reads_every_byte_the_vector_layout_reads(bits, rows_per_block):
    w, scales, biases = quantized(40, 5120, bits)  # 40 rows: a last block part empty at 16
    got = read_ceiling.read_vector(w, scales, biases, bits, rows_per_block)
    assert np.array(got).tolist() == read_ceiling.reference_vector(w, scales, biases, bits).tolist()


@needs_cuda
@pytest.mark.parametrize("blocks, unroll", [(3, 1), (3, 4), (read_ceiling.STREAM_BLOCKS, 4)])
def test_cuda_the_stream_reader_reads_every_word_once(blocks, unroll):
    w, scales, biases = quantized(96, 5120, 4)
    got = np.bitwise_xor.reduce(np.array(read_ceiling.read_stream(w, scales, biases, blocks, unroll)))
    assert int(got) == read_ceiling.reference_stream(w)
