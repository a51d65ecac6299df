# Issue 22: a first check of the tensor-core layout on the H200 (2026-12-03, the lease's last
# 130 s): its error against the float32 truth beside the served layouts', and microseconds per
# call of Qwen3-32B's gate_proj (25600 x 5120) at 1, 6 and 16 rows, MLX / mma / vector (median of
# 7 samples of 16 calls evaluated together). Run from the repository root, MLX CUDA on PYTHONPATH.
import time, sys
import mlx.core as mx
from mtplxd.engine.model import small_m_qmm as s
t0 = time.time()
for bits in (4, 8):
    for M in (1, 6, 21):
        print("err", bits, M, "mma", round(s.probe_error(M, bits, "mma", N=999, K=1024), 5),
              "vector" if M <= 6 else "word", round(s.probe_error(M, bits, "vector" if M <= 6 else "word", N=999, K=1024), 5),
              f"{time.time()-t0:.0f}s", flush=True)
for bits in (4, 8):
    N, K = 25600, 5120
    wt = (mx.random.normal((N, K)) * 0.02).astype(mx.bfloat16)
    w, sc, bi = mx.quantize(wt, group_size=64, bits=bits); mx.eval(w, sc, bi); del wt
    for M in (1, 6, 16):
        x = mx.random.normal((M, K)).astype(mx.bfloat16); mx.eval(x)
        fns = {"mlx": lambda x: mx.quantized_matmul(x, w, sc, bi, transpose=True, group_size=64, bits=bits),
               "mma": lambda x: s.small_m_matmul(x, w, sc, bi, bits, layout="mma")}
        if M <= 6: fns["vector"] = lambda x: s.small_m_matmul(x, w, sc, bi, bits, layout="vector")
        res = {}
        for name, f in fns.items():
            mx.eval([f(x) for _ in range(4)])
            ts = []
            for _ in range(7):
                a = time.perf_counter(); mx.eval([f(x) for _ in range(16)]); ts.append((time.perf_counter() - a) / 16 * 1e6)
            res[name] = round(sorted(ts)[3], 1)
        print("gate_proj 32B", bits, "bit M", M, res, f"{time.time()-t0:.0f}s", flush=True)
