"""Extend a trained TinyCoder's context: a new RoPE base, continued training on long windows.

The embedded model was trained on 1,024-token windows with RoPE base 10,000. This entry loads
a checkpoint (mtplxd/models/embedded by default), gives the trunk and the MTP layer the RoPE
base `--rope-theta` (ABF, "adjusted base frequency": Xiong et al. 2023, Code Llama; 1,000,000
is the base Qwen3 itself uses), and trains on long windows of the code stream (32k tokens by
default), optionally interleaved with the from-scratch recipe's short windows
(`--short-per-long`). A long window does not fit an unfused attention's L x L scores in memory
(MLX differentiates attention through its unfused fallback), so training runs attention a
query chunk at a time under gradient checkpointing (memory ~ chunk x L), and the MTP loss is
taken on each long window's last `--mtp-tail` anchors, which still attend to the whole window.

Before (unless --skip-baseline) and after, it reports held-out loss by position bucket up to
the full context (`evaluate.loss_by_position`), short-context perplexity and MTP acceptance,
into metrics.json; the weights go out as shards with config.json (install them with
`python -m training.export`). The commands that made the shipped model: training/README.md.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3

from training import evaluate, export
from training.mtp_model import TinyCoder, joint_loss
from training.train import BatchSampler, TrainConfig, load_data, model_args, run_eval, run_log, train

DEFAULT_INIT = Path(__file__).resolve().parent.parent / "mtplxd" / "models" / "embedded"
BUCKETS = (0, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


def load_init(path: Path, cfg: TrainConfig) -> TinyCoder:
    """The checkpoint at `path` rebuilt with cfg's RoPE base and context, in float32."""
    shipped = json.loads((path / "config.json").read_text())
    args = model_args(cfg, shipped["vocab_size"])
    for key in ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim"):
        if shipped[key] != getattr(args, key):
            raise SystemExit(f"{path} has {key}={shipped[key]}, preset {cfg.preset} has {getattr(args, key)}")
    model = TinyCoder(args)
    model.load_weights(list(mx.load(str(path / "model.safetensors")).items()), strict=True)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def _chunked_attention(attn: qwen3.Attention, x: mx.array, chunk: int) -> mx.array:
    """qwen3 causal self-attention (no cache) computed `chunk` queries at a time.

    Each chunk's scores are recomputed in the backward pass (mx.checkpoint), so memory holds
    one [B, heads, chunk, L] block instead of the whole L x L.
    """
    b, length, _ = x.shape
    q = attn.q_norm(attn.q_proj(x).reshape(b, length, attn.n_heads, -1)).transpose(0, 2, 1, 3)
    k = attn.k_norm(attn.k_proj(x).reshape(b, length, attn.n_kv_heads, -1)).transpose(0, 2, 1, 3)
    v = attn.v_proj(x).reshape(b, length, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    q, k = attn.rope(q), attn.rope(k)

    def block(qc, kc, vc):
        # "causal" with fewer queries than keys aligns the last query with the last key.
        return mx.fast.scaled_dot_product_attention(qc, kc, vc, scale=attn.scale, mask="causal")

    block = mx.checkpoint(block)
    outs = [block(q[:, :, s:s + chunk], k[:, :, :s + chunk], v[:, :, :s + chunk])
            for s in range(0, length, chunk)]
    o = mx.concatenate(outs, axis=2).transpose(0, 2, 1, 3).reshape(b, length, -1)
    return attn.o_proj(o)


def _layer_fn(layer: qwen3.TransformerBlock, chunk: int):
    """The block's forward as a checkpointed function of (its parameters, input)."""

    def forward(params, x):
        layer.update(params)
        h = x + _chunked_attention(layer.self_attn, layer.input_layernorm(x), chunk)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    return mx.checkpoint(forward)


def long_hidden(model: TinyCoder, inputs: mx.array, chunk: int) -> mx.array:
    """model.hidden(inputs) with chunked attention and per-layer checkpointing (same values)."""
    h = model.model.embed_tokens(inputs)
    for layer in model.model.layers:
        h = _layer_fn(layer, chunk)(layer.trainable_parameters(), h)
    return model.model.norm(h)


def long_loss(model: TinyCoder, window: mx.array, mtp_weights: tuple[float, ...], chunk: int,
              tail: int) -> tuple[mx.array, mx.array]:
    """joint_loss on a long window: next-token CE on every position, MTP CE on the last `tail`."""
    depth = len(mtp_weights)
    length = window.shape[1] - 1 - depth
    h = long_hidden(model, window[:, :length], chunk)
    ce = nn.losses.cross_entropy
    main = ce(model.logits_from_hidden(h).astype(mx.float32), window[:, 1:length + 1]).mean()
    tail = min(tail, length)
    feeds = [window[:, 1 + s:length + 1 + s] for s in range(depth)]
    losses = [main]
    for s, g in enumerate(model.mtp_chain(h, feeds, tail=tail)):
        target = window[:, 2 + s + length - tail:length + 2 + s]
        losses.append(ce(model.logits_from_hidden(g).astype(mx.float32), target).mean())
    total = main
    for w, part in zip(mtp_weights, losses[1:]):
        total = total + w * part
    return total, mx.stack(losses)


class MixedBatches:
    """Step i's batch: one long window, then `short_per_long` batches of short windows, repeating.

    Long windows teach the far positions; the short ones, the from-scratch recipe's own batches,
    keep what the model does at the start of a context (a run of long windows alone moved
    held-out 512-token perplexity from 9.69 to 13.83).
    """

    def __init__(self, arrays: dict, eot: int, cfg: TrainConfig, short_batch: int, short_len: int,
                 short_per_long: int):
        depth = len(cfg.mtp_weights)
        self.long = BatchSampler(arrays["code_train"], arrays["chat_train"], eot,
                                 cfg.seq_len + 1 + depth, cfg.chat_fraction, cfg.seed)
        self.short = BatchSampler(arrays["code_train"], arrays["chat_train"], eot,
                                  short_len + 1 + depth, cfg.chat_fraction, cfg.seed + 1)
        self.batch, self.short_batch, self.period = cfg.batch, short_batch, short_per_long + 1

    def __call__(self, step: int):
        """[B, L] int32 windows for `step`."""
        return self.long(self.batch) if step % self.period == 0 else self.short(self.short_batch)


def evaluate_model(model: TinyCoder, cfg: TrainConfig, arrays: dict, a: argparse.Namespace) -> dict:
    """Loss by position up to the context, then short-context perplexity and acceptance."""
    t = time.perf_counter()
    edges = [e for e in a.buckets if e < a.eval_len] + [a.eval_len]
    out = {"loss_by_position": evaluate.loss_by_position(
        model, arrays["code_heldout"], a.eval_len, a.eval_windows, a.eval_chunk, edges)}
    out.update(run_eval(model, cfg, arrays, a.quick_eval))
    out["seconds"] = round(time.perf_counter() - t, 1)
    return out


def _speed_steps(short_per_long: int) -> tuple[int, int]:
    """Steps between which the schedule's speed is timed: whole long+short periods, after the
    first (which builds the kernels of both shapes)."""
    period = short_per_long + 1
    return (1 + period, 1 + 3 * period) if short_per_long else (2, 6)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags (defaults: the shipped 64k run)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--init", type=Path, default=DEFAULT_INIT, help="checkpoint folder to start from")
    ap.add_argument("--preset", default="coder-deep")
    ap.add_argument("--rope-theta", type=float, default=1_000_000.0)
    ap.add_argument("--context", type=int, default=65536, help="max_position_embeddings written")
    # 32k windows: 64k ones ran out of memory on the H200 (141 GB) at step 2 even at 1024-query
    # blocks; 32k trained the positions to 64k flat (training/README.md, "Long context").
    ap.add_argument("--seq-len", type=int, default=32768, help="long training window")
    ap.add_argument("--batch", type=int, default=1, help="long windows per long step")
    ap.add_argument("--attn-chunk", type=int, default=1024, help="queries per attention block")
    ap.add_argument("--mtp-tail", type=int, default=512, help="anchors per long window the MTP loss covers")
    ap.add_argument("--short-per-long", type=int, default=0,
                    help="short-window steps after each long one (0: long windows only)")
    ap.add_argument("--short-batch", type=int, default=32)
    ap.add_argument("--short-seq-len", type=int, default=1024)
    # MLX keeps freed buffers for reuse; with steps this large the cache grew until CUDA could
    # not instantiate the next step's graph. 4 GiB is what the successful run used.
    ap.add_argument("--cache-limit-gb", type=float, default=4.0, help="MLX buffer cache cap (0: MLX default)")
    # Under a sixth of the from-scratch peak (2e-3): Adam's first steps move every weight by
    # about lr, and at 1e-3 a CPU trial (512-token windows) went from loss 2.8 to 7.2 in 6 steps.
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=0)
    # Off by default: a step of 64k tokens is bound by attention's memory traffic, not kernel
    # launches, so fusion gains little, while the CUDA kernel builds would eat the budget.
    ap.add_argument("--compile", action="store_true", help="mx.compile the training step")
    ap.add_argument("--time-budget", type=float, default=280.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-len", type=int, default=65536)
    ap.add_argument("--eval-windows", type=int, default=4)
    ap.add_argument("--eval-chunk", type=int, default=2048)
    ap.add_argument("--buckets", type=lambda s: [int(x) for x in s.split(",")], default=list(BUCKETS))
    ap.add_argument("--skip-baseline", action="store_true", help="do not evaluate the --init model")
    ap.add_argument("--quick-eval", action="store_true", help="tiny evaluation (CPU dry run)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Evaluate the init model, train it at the new base and context, save, evaluate again."""
    a = parse_args(argv)
    if a.cache_limit_gb:
        mx.set_cache_limit(int(a.cache_limit_gb * 2**30))
    cfg = TrainConfig(preset=a.preset, seed=a.seed, steps=a.steps, time_budget=a.time_budget,
                      batch=a.batch, seq_len=a.seq_len, lr=a.lr, warmup=a.warmup,
                      rope_theta=a.rope_theta, max_position_embeddings=a.context,
                      speed_steps=_speed_steps(a.short_per_long), log_every=5, compile=a.compile)
    log = run_log(a.out)

    arrays, meta = load_data(a.data)
    metrics: dict = {"config": asdict(cfg), "init": str(a.init),
                     "long_context": {k: v for k, v in vars(a).items() if k not in ("data", "out", "init")}}

    def save_metrics():
        (a.out / "metrics.json").write_text(json.dumps(metrics, indent=1, default=str) + "\n")

    if not a.skip_baseline:
        shipped = json.loads((a.init / "config.json").read_text())
        old_cfg = replace(cfg, rope_theta=shipped["rope_theta"],
                          max_position_embeddings=shipped["max_position_embeddings"])
        metrics["eval_init"] = evaluate_model(load_init(a.init, old_cfg), old_cfg, arrays, a)
        log("init " + json.dumps(metrics["eval_init"]))
        save_metrics()

    model = load_init(a.init, cfg)
    weights = tuple(cfg.mtp_weights)

    def loss(m, x):
        if x.shape[1] <= a.short_seq_len + 1 + len(weights):
            return joint_loss(m, x, weights)
        return long_loss(m, x, weights, a.attn_chunk, a.mtp_tail)

    batches = None
    if a.short_per_long:
        batches = MixedBatches(arrays, meta["special_ids"]["<|endoftext|>"], cfg, a.short_batch,
                               a.short_seq_len, a.short_per_long)
    model, history = train(cfg, arrays, meta, log, model=model, objective=loss, batches=batches)
    metrics["history"] = history
    metrics["peak_memory_gb"] = round(mx.get_peak_memory() / 1e9, 2)
    im_end = meta["special_ids"]["<|im_end|>"]
    # Evaluate what ships: the bfloat16 weights, computed in float32 like the baseline.
    export.save_run(model, model_args(cfg, meta["vocab_size"]), a.out, im_end)
    save_metrics()
    metrics["eval_new"] = evaluate_model(model, cfg, arrays, a)
    log("new " + json.dumps(metrics["eval_new"]))
    metrics["probes"] = [{"prompt": p["prompt"], "completion_ids": evaluate.greedy_complete(
        model, p["ids"], 48 if a.quick_eval else 160, {im_end, meta["special_ids"]["<|endoftext|>"]})}
        for p in meta.get("probes", [])]
    save_metrics()
    log("done")


if __name__ == "__main__":
    main()
