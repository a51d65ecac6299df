"""Where the time goes in real_size's first steps on the GPU: timestamps per phase."""
import sys, time
t0 = time.perf_counter()
def say(msg):
    print(f"[{time.perf_counter() - t0:7.2f}s] {msg}", flush=True)
import mlx.core as mx
say(f"mlx {mx.__version__} {mx.default_device()}")
from mtplxd.engine.bench import real_size
from mtplxd.engine.bench.ar_reference import mlx_lm_decode_ms, ours_decode_ms
from mtplxd.engine.model.trunk import Trunk
size, dtype = sys.argv[1], sys.argv[2]
model, spec = real_size.build_model(size, dtype)
say(f"built {size} {dtype}")
trunk = Trunk(model, spec)
vocab = trunk.text.args.vocab_size
prompt = mx.random.randint(0, vocab, (512,), key=mx.random.key(1)).tolist()
for i in range(3):
    ms = ours_decode_ms(trunk, prompt[:64], 4, 0.0)
    say(f"ours decode warm {i}: {ms:.2f} ms/token")
for i in range(3):
    ms = mlx_lm_decode_ms(model, prompt[:64], 4, 0.0)
    say(f"mlx-lm decode warm {i}: {ms:.2f} ms/token")
for i in range(2):
    ms = ours_decode_ms(trunk, prompt, 16, 0.0)
    say(f"ours decode 512 ctx {i}: {ms:.2f} ms/token")
    ms = mlx_lm_decode_ms(model, prompt, 16, 0.0)
    say(f"mlx-lm decode 512 ctx {i}: {ms:.2f} ms/token")
for T in (0.0, 0.6):
    for d in (1, 3):
        r = real_size.loop_cycle_ms(trunk, model.mtp, prompt, d, T, 6)
        say(f"cycle T={T} depth {d}: {r}")
