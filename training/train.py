"""Train mtplx-tiny-coder: qwen3 trunk + one MTP layer, joint next-token and MTP loss.

Imports only mlx, mlx_lm, numpy and the standard library (the H200 machine has nothing else).
Reads the packed data of training/pack.py, trains for --steps or until --time-budget seconds,
evaluates held-out perplexity and MTP acceptance by depth at T=0 and T=0.6, and writes the
weights (sharded, for the device's 16 MiB file limit) plus metrics.json into --out.

Recipe of the shipped model (docs/models.md, training/README.md):
    python -m training.train --preset coder-deep --data train-out/data --out $OUT --seed 0 \
        --time-budget 500
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from training import evaluate, export
from training.mtp_model import TinyCoder, TinyCoderArgs, joint_loss

PRESETS = {
    # The embedded model until 2026-11-30: ~17.6M parameters, 35 MB in bfloat16.
    "coder": dict(hidden_size=384, num_hidden_layers=8, intermediate_size=1024,
                  num_attention_heads=6, num_key_value_heads=2, head_dim=64),
    # The shipped model (18.1M parameters, 36 MB in bfloat16). The same size, deeper and
    # narrower: on a launch-bound GPU an MTP draft step costs about one layer, so the draft
    # is cheaper relative to the trunk the more layers the trunk has.
    "coder-deep": dict(hidden_size=256, num_hidden_layers=22, intermediate_size=640,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    # For the CPU test and the end-to-end dry run.
    "tiny": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=32),
}


@dataclass
class TrainConfig:
    """Everything that determines a run (recorded in metrics.json)."""

    preset: str = "coder-deep"
    seed: int = 0
    steps: int = 0                  # 0 = as many as --time-budget allows
    time_budget: float = 450.0      # wall seconds of the training loop, compilation included
    batch: int = 32
    seq_len: int = 1024
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 200
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    chat_fraction: float = 0.15     # share of batch rows drawn from the instruction pairs
    mtp_weights: tuple = (0.5, 0.25, 0.15)   # loss weight of MTP draft steps 1, 2, 3
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    speed_steps: tuple = (10, 40)   # steps between which the speed that fixes the schedule is timed
    log_every: int = 50
    compile: bool = True            # mx.compile the step (on CUDA: ~100 s of kernel builds first)


def model_args(cfg: TrainConfig, vocab_size: int) -> TinyCoderArgs:
    """TinyCoderArgs for the preset."""
    return TinyCoderArgs(model_type="qwen3", rms_norm_eps=1e-6, vocab_size=vocab_size,
                         max_position_embeddings=cfg.max_position_embeddings,
                         tie_word_embeddings=True, rope_theta=cfg.rope_theta,
                         **PRESETS[cfg.preset])


def load_data(data_dir: Path) -> tuple[dict[str, np.ndarray], dict]:
    """The token streams of tokens.npz and meta.json."""
    with np.load(data_dir / "tokens.npz") as z:
        arrays = {k: z[k] for k in z.files}
    return arrays, json.loads((data_dir / "meta.json").read_text())


class BatchSampler:
    """Random windows: code at random offsets, chat starting at an exchange's first token."""

    def __init__(self, code: np.ndarray, chat: np.ndarray, eot: int, window: int,
                 chat_fraction: float, seed: int):
        self.code, self.chat, self.window = code, chat, window
        self.rng = np.random.default_rng(seed)
        starts = np.flatnonzero(chat == eot) + 1
        self.chat_starts = np.concatenate([[0], starts[starts + window <= chat.size]])
        self.chat_fraction = chat_fraction if chat.size > window else 0.0

    def __call__(self, batch: int) -> np.ndarray:
        """[batch, window] int32 token windows."""
        rows = []
        for _ in range(batch):
            if self.rng.random() < self.chat_fraction:
                s = int(self.rng.choice(self.chat_starts))
                rows.append(self.chat[s:s + self.window])
            else:
                s = int(self.rng.integers(0, self.code.size - self.window))
                rows.append(self.code[s:s + self.window])
        return np.stack(rows).astype(np.int32)


def lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    """Linear warmup then cosine decay to min_lr_ratio * lr."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = min(1.0, (step - cfg.warmup) / max(1, total - cfg.warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def train(cfg: TrainConfig, arrays: dict[str, np.ndarray], meta: dict, log=print,
          model: TinyCoder | None = None, objective=None, batches=None) -> tuple[TinyCoder, dict]:
    """Train a model per cfg; return it and a history dict (losses, steps, tokens, seconds).

    `model` continues a trained one (default: fresh weights of cfg's preset); `objective(model,
    window) -> (total, parts)` replaces joint_loss, and `batches(step) -> [B, L] int32` the
    sampler of cfg's windows (training/long_context.py mixes long and short windows).
    """
    mx.random.seed(cfg.seed)
    if model is None:
        model = TinyCoder(model_args(cfg, meta["vocab_size"]))
    mx.eval(model.parameters())
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    log(f"params {n_params/1e6:.2f}M preset={cfg.preset} device={mx.default_device()}")
    eot = meta["special_ids"]["<|endoftext|>"]
    depth = len(cfg.mtp_weights)
    sampler = BatchSampler(arrays["code_train"], arrays["chat_train"], eot,
                           cfg.seq_len + 1 + depth, cfg.chat_fraction, cfg.seed)
    opt = optim.AdamW(learning_rate=cfg.lr, weight_decay=cfg.weight_decay)
    # Create the optimizer state now: lazily created state changes the compiled graph's inputs
    # after step 1 and forces a second (minute-long on CUDA) compilation.
    opt.init(model.trainable_parameters())
    weights = tuple(cfg.mtp_weights)

    def loss_fn(m, x):
        return objective(m, x) if objective else joint_loss(m, x, weights)

    grad_fn = nn.value_and_grad(model, loss_fn)
    state = [model.state, opt.state]

    def step_fn(x, lr):
        (loss, parts), grads = grad_fn(model, x)
        grads, _ = optim.clip_grad_norm(grads, cfg.grad_clip)
        opt.learning_rate = lr
        opt.update(model, grads)
        return loss, parts

    if cfg.compile:
        step_fn = partial(mx.compile, inputs=state, outputs=state)(step_fn)

    history = {"step": [], "loss": [], "parts": []}
    total = cfg.steps or 10**9
    t0 = time.perf_counter()
    step = tokens = 0
    while step < total:
        x = mx.array(batches(step) if batches else sampler(cfg.batch))
        tokens += x.shape[0] * (x.shape[1] - 1 - depth)
        loss, parts = step_fn(x, mx.array(lr_at(step, total, cfg)))
        mx.eval(loss, parts)
        step += 1
        first, last = cfg.speed_steps
        if step == first:
            t_first = time.perf_counter()
        if step == last and not cfg.steps:
            # Fix the schedule's length from the steady speed (the first steps include kernel
            # compilation) so the cosine ends when the wall-clock budget does.
            now = time.perf_counter()
            per_step = (now - t_first) / (last - first)
            total = max(step + 1, step + int((cfg.time_budget - (now - t0)) / per_step))
            log(f"{per_step*1000:.1f} ms/step -> {total} steps in {cfg.time_budget:.0f}s")
        if not cfg.steps and time.perf_counter() - t0 > cfg.time_budget:
            # The device machine's limit is hard: a run slower than measured stops on time.
            log(f"time budget spent at step {step} of {total}")
            total = step
        if step % cfg.log_every == 0 or step == total or step <= 3:
            history["step"].append(step)
            history["loss"].append(round(loss.item(), 4))
            history["parts"].append([round(p, 4) for p in parts.tolist()])
            log(f"step {step}/{total} loss {loss.item():.4f} parts {[round(p, 3) for p in parts.tolist()]} "
                f"t {time.perf_counter()-t0:.0f}s")
    seconds = time.perf_counter() - t0
    history.update(steps=step, seconds=round(seconds, 1), params=n_params,
                   tokens=tokens)
    return model, history


def run_log(out_dir: Path):
    """A log function that prints a line and appends it to out_dir/train.log (created)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    logf = open(out_dir / "train.log", "w")

    def log(msg: str) -> None:
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    return log


def run_eval(model: TinyCoder, cfg: TrainConfig, arrays: dict[str, np.ndarray], quick: bool) -> dict:
    """Held-out perplexity (code, chat) and acceptance by depth at T=0 and T=0.6."""
    depth = len(cfg.mtp_weights)
    seq = min(cfg.seq_len, 512)
    n_win = 8 if quick else 256
    out = {"ppl_code_heldout": round(evaluate.perplexity(model, arrays["code_heldout"], seq, max_windows=n_win), 3),
           "ppl_chat_heldout": round(evaluate.perplexity(model, arrays["chat_heldout"], seq, max_windows=n_win), 3)}
    kw = dict(prompts=4, prompt_len=16, new_tokens=16) if quick else {}
    out["acceptance"] = [evaluate.acceptance(model, arrays["code_heldout"], depth, t, **kw) for t in (0.0, 0.6)]
    return out


def main() -> None:
    """CLI entry: train, evaluate (float32 and the shipped dtype), save shards and metrics."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", default="coder-deep", choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--time-budget", type=float, default=450.0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--quick-eval", action="store_true", help="tiny evaluation (CPU dry run)")
    a = ap.parse_args()
    cfg = TrainConfig(preset=a.preset, seed=a.seed, steps=a.steps, time_budget=a.time_budget,
                      batch=a.batch, seq_len=a.seq_len, lr=a.lr, warmup=a.warmup)
    log = run_log(a.out)

    arrays, meta = load_data(a.data)
    model, history = train(cfg, arrays, meta, log)
    metrics = {"config": asdict(cfg), "history": history, "data_meta": {k: v for k, v in meta.items() if k != "probes"}}

    def save_metrics():
        (a.out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")

    # Weights first, so a run cut short by its time limit still returns them.
    args = model_args(cfg, meta["vocab_size"])
    im_end = meta["special_ids"]["<|im_end|>"]
    (a.out / "config.json").write_text(json.dumps(export.checkpoint_config(args, im_end, "bfloat16"), indent=2) + "\n")
    export.save_shards(model, a.out, mx.bfloat16)
    save_metrics()
    t = time.perf_counter()
    metrics["eval_float32"] = run_eval(model, cfg, arrays, a.quick_eval)
    log(json.dumps(metrics["eval_float32"]))
    save_metrics()
    model.set_dtype(mx.bfloat16)
    metrics["eval_bfloat16"] = run_eval(model, cfg, arrays, a.quick_eval)
    log(json.dumps(metrics["eval_bfloat16"]))
    metrics["probes"] = [{"prompt": p["prompt"], "completion_ids": evaluate.greedy_complete(
        model, p["ids"], 48 if a.quick_eval else 320, {im_end, meta["special_ids"]["<|endoftext|>"]})}
        for p in meta.get("probes", [])]
    metrics["eval_seconds"] = round(time.perf_counter() - t, 1)
    save_metrics()
    log("done")


if __name__ == "__main__":
    main()
