"""Comparisons for exactness tests: bitwise where MLX's CPU matmuls compute each row alone.

MLX's bundled reference BLAS computes every element of a matmul with the same loop whatever
the matrix's shape, so a verify over K+1 rows, a trimmed cache and a direct forward agree
bit for bit. OpenBLAS (the Linux default, see mtplxd.blas) picks kernels by shape, so there
they agree to rounding, and each module that compares bits also runs its bitwise tests in a
child process on the reference BLAS (`run_on_reference_blas`).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import mlx.core as mx

from mtplxd import blas

ROWS_ALONE = blas.activate().kind == blas.BUNDLED
# A few units in the last place of each dtype: what a different summation order can change.
_RTOL = {mx.float32: 1e-4, mx.bfloat16: 2.0**-6, mx.float16: 2.0**-9}


def same(got: mx.array, want: mx.array) -> bool:
    """Bitwise equal under a row-alone BLAS; equal shape, dtype and values to rounding else."""
    if ROWS_ALONE:
        return bool(mx.array_equal(got, want).item())
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    rtol = _RTOL.get(want.dtype, 0.0)
    # Rounding is relative to the array's scale, not to each element: a logit near zero among
    # logits of size 14 moves by as much as the large ones do (2.8e-5 seen on OpenBLAS).
    scale = max(1.0, mx.max(mx.abs(want)).item()) if want.size else 1.0
    return bool(mx.allclose(got, want, rtol=rtol, atol=rtol / 10 * scale).item())


def run_on_reference_blas(*pytest_args: str, expect_passed: int) -> None:
    """Run pytest (node ids, -k ...) in a child whose MLX uses its bundled BLAS: there the
    comparisons are bitwise; at least `expect_passed` tests must pass and none fail."""
    env = {**os.environ, blas.ENV: "bundled"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:]
    passed = re.search(r"(\d+) passed", done.stdout)
    assert passed and int(passed.group(1)) >= expect_passed, done.stdout[-1000:]


def assert_computes_as(changed, reference, ids: list[int], max_tokens: int = 12) -> None:
    """A loaded model changed in how it computes (`changed`) against the same checkpoint as
    loaded (`reference`): the prompt's logits bit for bit, and greedy AR and MTP (depth 3)
    tokens equal to the reference's greedy AR tokens."""
    from mtplxd.engine import GenerationRequest, SamplingParams

    logits = [m.trunk.forward(mx.array([ids]), m.trunk.make_cache(), all_logits=True)[1] for m in (reference, changed)]
    assert mx.array_equal(*logits).item()

    def run(model, depth: int) -> list[int]:
        sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return model.complete(GenerationRequest(ids, sampling, depth=depth)).token_ids

    assert run(changed, 0) == run(changed, 3) == run(reference, 0)
