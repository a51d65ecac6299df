"""Held-out code loss by position, through the serving engine instead of the training model.

    python -m training.serving_positions --model mtplxd/models/embedded [--length 65536]
        [--start 0] [--data train-out/data] [--json-out FILE]

`training.evaluate.loss_by_position` runs the training model, whose attention on the CPU
backend is MLX's unfused one: a 65,536-token window would take hours on a laptop-class CPU.
This scores the same window through the daemon's own path (`LoadedModel.score`: prefill in
chunks, numpy block-wise attention for long chunks on the CPU), so a CPU can check a model's
full context in about 20 minutes (2 vCPUs). Buckets are `long_context.BUCKETS` up to the
length; the loss at position i predicts token i + 1, as in `loss_by_position`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from mtplxd.engine import load_model
from training.evaluate import bucket_losses
from training.long_context import BUCKETS

REPO = Path(__file__).resolve().parent.parent


def serving_loss_by_position(model_path: Path, tokens: np.ndarray, length: int, start: int = 0) -> dict:
    """One window of `length` tokens from `start`, scored by the serving engine."""
    if tokens.size < start + length + 1:
        raise ValueError(f"{tokens.size} held-out tokens cannot fill a {length}-token window at {start}")
    window = tokens[start:start + length + 1].astype(np.int64).tolist()
    began = time.perf_counter()
    logprobs = load_model(model_path).score(window)  # logprobs[i] = log p(window[i] | window[:i])
    losses = -np.array(logprobs[1:], dtype=np.float64)
    edges = [e for e in BUCKETS if e < length] + [length]
    return {"model": str(model_path), "length": length, "start": start,
            "buckets": bucket_losses(losses, edges), "seconds": round(time.perf_counter() - began, 1)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=REPO / "mtplxd" / "models" / "embedded")
    ap.add_argument("--data", type=Path, default=REPO / "train-out" / "data", help="training/pack.py output")
    ap.add_argument("--length", type=int, default=65536)
    ap.add_argument("--start", type=int, default=0, help="first token of the window in the held-out code")
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args(argv)
    tokens = np.load(a.data / "tokens.npz")["code_heldout"]
    report = serving_loss_by_position(a.model, tokens, a.length, a.start)
    print(json.dumps(report), flush=True)
    if a.json_out:
        a.json_out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
