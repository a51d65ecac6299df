"""tests/support/cuda_emulator.py: the CPU stand-in for a GPU that checks a kernel's logic.

Its mma.sync is trusted only because a kernel that passes its CUDA tests on H100s and H200s
(small_m_qmm's mma layout, docs/benchmarks.md) computes the right product through it too.
"""

import shutil

import numpy as np
import pytest

from mtplxd.engine.model import small_m_qmm
from tests.support import cuda_emulator

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed here")


def test_bf16_rounding_is_to_nearest_even():
    values = np.array([1.0, 1.00390625, 1.01171875, -2.5, 3.0e-3], np.float32)  # 1 + 2^-8: a tie, to even
    assert cuda_emulator.bf16_values(cuda_emulator.bf16_bits(values)).tolist() == [
        1.0, 1.0, 1.015625, -2.5, pytest.approx(3.0e-3, rel=4e-3)]


@pytest.mark.parametrize("rows,warps", [(3, 2), (8, 1)])
def test_the_emulated_tensor_cores_run_the_gpu_proven_mma_layout(tmp_path, rows, warps):
    """small_m_qmm's mma layout (4-bit, its CUDA tests pass on the GPU) through the emulator
    gives x @ W^T of the dequantized weights: 32 output columns (two blocks), K of two groups
    (split between the warps where there are two), rows in one 8-row tile."""
    rng = np.random.default_rng(rows)
    n, k, group = 32, 128, small_m_qmm.GROUP_SIZE
    q = rng.integers(0, 16, (n, k), dtype=np.uint32)
    w = np.zeros((n, k // 8), np.uint32)
    for i in range(8):  # value i of a word in bits 4i (MLX's packing)
        w |= q[:, i::8] << (4 * i)
    scales = cuda_emulator.bf16_bits(rng.uniform(0.01, 0.1, (n, k // group)).astype(np.float32))
    biases = cuda_emulator.bf16_bits(rng.uniform(-0.5, 0.5, (n, k // group)).astype(np.float32))
    x = cuda_emulator.bf16_bits(rng.standard_normal((rows, k)).astype(np.float32))
    library = cuda_emulator.build(
        "small_m_mma", small_m_qmm._SOURCE_MMA, small_m_qmm._HEADER,
        [("x", "T"), ("w", "uint32_t"), ("scales", "T"), ("biases", "T")], [("out", "T")],
        {"T": "__nv_bfloat16", "BF16": True, "BITS": 4, "GS": group, "MT": 1, "KW": warps, "U": 1,
         "HOIST": False}, tmp_path)
    out = np.zeros((rows, n), np.uint16)
    cuda_emulator.launch(library, [x, w, scales, biases], [out], (n // 16, 1, 1), 32 * warps, 0)
    dequantized = (np.repeat(cuda_emulator.bf16_values(scales), group, axis=1) * q
                   + np.repeat(cuda_emulator.bf16_values(biases), group, axis=1))
    want = cuda_emulator.bf16_values(x).astype(np.float64) @ dequantized.T.astype(np.float64)
    got = cuda_emulator.bf16_values(out)
    assert np.abs(got - want).max() <= 0.01 * np.abs(want).max()
