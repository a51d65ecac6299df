"""The decoding loops: speculative (stepwise) and fused MTP cycles, plain AR, sampling,
detokenizing, and the CUDA buffer-attention kernel the fused cycle attends through.

May import: mlx, mlx-lm, numpy, `mtplxd.engine.interface` and `mtplxd.engine.model`; never
the session bank, benchmarks or fixtures.
"""
