"""What drafting from the unfiltered q costs in acceptance: first-draft acceptance on
held-out tokens, with the draft's q filtered like p (the old rule) and without top-p/top-k
(sampling.draft_weights, the engine's rule).

    python -m mtplxd.engine.bench.draft_overlap --model PATH --tokens FILE.npz:ARRAY
        [--windows 8] [--length 256] [--json-out FILE]

For each position t of a window, the head drafts from the trunk's true hidden h_t and the
true next token x_{t+1}, as in a cycle's first draft step. A draft from q is accepted with
probability sum_x min(p(x), q(x)), p being the trunk's sampling distribution for the same
token; the figures are its mean over all positions. The embedded model's held-out code is
`train-out/data/tokens.npz:code_heldout` (training/README.md rebuilds it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

from mtplxd.engine.bench.harness import bench_parser, command_line, write_report
from mtplxd.engine.decoding.sampling import draft_weights, probabilities, scaled_logits
from mtplxd.engine.interface import SamplingParams

PROG = "python -m mtplxd.engine.bench.draft_overlap"
SETTINGS = (
    SamplingParams(temperature=0.6, top_p=0.95),
    SamplingParams(temperature=0.6, top_p=0.95, top_k=20),  # Qwen3's thinking-mode advice
    SamplingParams(temperature=0.7, top_p=0.8, top_k=20),  # ... and non-thinking
    SamplingParams(temperature=1.0, min_p=0.05),
)


def window_logits(model, tokens: list[int]) -> tuple[mx.array, mx.array]:
    """(p logits, first-draft q logits), both (len(tokens) - 2, V): row t is for token t+2."""
    trunk, head = model.trunk, model.head
    ids = mx.array(tokens)[None]
    hidden, logits = trunk.forward(ids, trunk.make_cache(), all_logits=True)
    g = head(hidden[:, :-2], trunk.embed(ids[:, 1:-1]), trunk.make_head_cache(head))
    return logits[0, 1:-1].astype(mx.float32), trunk.draft_logits(g)[0].astype(mx.float32)


def acceptance(p_logits: mx.array, q_logits: mx.array, params: SamplingParams) -> dict[str, float]:
    """Mean first-draft acceptance with q filtered like p and with the engine's q."""
    p = probabilities(p_logits, params, None, None)
    rules = {"q filtered like p": mx.softmax(scaled_logits(q_logits, params), axis=-1),
             "q without top-p/top-k (engine)": mx.softmax(draft_weights(q_logits, params), axis=-1)}
    return {name: mx.mean(mx.sum(mx.minimum(p, q), axis=-1)).item() for name, q in rules.items()}


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = bench_parser(PROG, __doc__)
    parser.add_argument("--model", required=True, help="HF-format model folder with an MTP head")
    parser.add_argument("--tokens", required=True, help="FILE.npz:ARRAY of held-out token ids")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args(argv)

    from mtplxd.engine.loaded_model import load_model

    model = load_model(args.model, quantize="none")
    if model.head is None:
        print(f"{model.info.id} has no MTP head to measure", file=sys.stderr)
        return 2
    file, _, name = args.tokens.partition(":")
    with np.load(file) as arrays:
        stream = arrays[name or arrays.files[0]]
    starts = np.linspace(0, stream.size - args.length - 1, args.windows).astype(int)
    pairs = [window_logits(model, stream[s:s + args.length].tolist()) for s in starts]
    p_all = mx.concatenate([p for p, _ in pairs])
    q_all = mx.concatenate([q for _, q in pairs])
    report = []
    for params in SETTINGS:
        row = {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
               "min_p": params.min_p, **acceptance(p_all, q_all, params)}
        report.append(row)
        print(json.dumps(row))
    if args.json_out:
        write_report(args.json_out, {"positions": int(p_all.shape[0]), "settings": report,
                                     "command": command_line(PROG, argv)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
