"""One process: the embedded model, AR (depth 0) and MTP depth 3, greedy and T=0.6 top-p 0.95,
160 tokens each after a warm-up; prints CPU and wall ms per token as one JSON line. Run from
the root of each tree under test (issue 22 point 5: main against the branch, alternating)."""
import json, time
from mtplxd.engine import GenerationRequest, SamplingParams, load_model
m = load_model("mtplxd/models/embedded")
prompt = m.tokenizer.encode("def parse_args(argv):\n    \"\"\"Parse command line arguments.\"\"\"\n")
out = {}
for depth in (0, 3):
    for T in (0.0, 0.6):
        p = SamplingParams(temperature=T, top_p=0.95 if T else 1.0, max_tokens=8, seed=1, ignore_eos=True)
        m.complete(GenerationRequest(prompt, p, depth=depth))  # warm-up
        p = SamplingParams(temperature=T, top_p=0.95 if T else 1.0, max_tokens=160, seed=1, ignore_eos=True)
        c0, w0 = time.process_time(), time.perf_counter()
        r = m.complete(GenerationRequest(prompt, p, depth=depth))
        out[f"d{depth}_T{T}"] = {"cpu_ms_per_token": (time.process_time() - c0) * 1000 / len(r.token_ids),
                                 "wall_ms_per_token": (time.perf_counter() - w0) * 1000 / len(r.token_ids)}
print(json.dumps(out))
