import time, sys, mlx.core as mx, numpy as np
from mtplxd.engine.model import cpu_attention as ca
def best(f, reps=3):
    r=[]
    for _ in range(reps):
        t=time.perf_counter(); c=time.process_time(); y=f(); mx.eval(y); r.append((time.perf_counter()-t, time.process_time()-c))
    return min(r)
def case(L, S, dtype):
    q = mx.random.normal((1,4,L,64), key=mx.random.key(0)).astype(dtype)
    k = mx.random.normal((1,2,S,64), key=mx.random.key(1)).astype(dtype)
    v = mx.random.normal((1,2,S,64), key=mx.random.key(2)).astype(dtype)
    mx.eval(q,k,v)
    m = best(lambda: mx.fast.scaled_dot_product_attention(q,k,v,scale=0.125,mask="causal"), 2 if S>4000 else 3)
    n = best(lambda: ca.causal_attention(q,k,v,0.125))
    print(f"L={L} S={S} mlx {m[0]:.3f}s/{m[1]:.3f}cpu numpy {n[0]:.3f}s/{n[1]:.3f}cpu  x{m[0]/n[0]:.1f}", flush=True)
for L,S in [(64,64),(64,256),(128,256),(256,256),(512,512),(512,1024),(512,4096),(512,16384)]:
    case(L,S,mx.bfloat16)
