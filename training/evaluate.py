"""Held-out perplexity and MTP acceptance by depth for a TinyCoder.

Acceptance is measured the way speculative decoding lives it, in parallel: the trunk first
generates continuations of held-out code prompts at temperature T (greedy at T=0); then, for
every anchor t in the generated part, the MTP chain drafts from (h_t, x_{t+1}) with the
generated tokens as its inputs. A draft step's acceptance probability is sum_x min(p(x), q(x))
for the trunk's and the head's distributions at T (at T=0: 1 if their argmaxes agree), and a
depth-k draft survives with the product over steps 1..k. At T=0 this equals the engine's
greedy acceptance exactly; at T>0 it is the standard estimate (the chain is fed the trunk's own
sample rather than the draft that was accepted).
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from training.mtp_model import TinyCoder


def perplexity(model: TinyCoder, tokens: np.ndarray, seq_len: int, batch: int = 16,
               max_windows: int = 256) -> float:
    """Next-token perplexity over consecutive non-overlapping windows of `tokens`."""
    n = min(max_windows, (tokens.size - 1) // seq_len)
    total, count = 0.0, 0
    for i in range(0, n, batch):
        rows = [tokens[j * seq_len:j * seq_len + seq_len + 1] for j in range(i, min(n, i + batch))]
        x = mx.array(np.stack(rows).astype(np.int32))
        logits = model(x[:, :-1]).astype(mx.float32)
        ce = mx.logsumexp(logits, axis=-1) - mx.take_along_axis(logits, x[:, 1:, None], -1)[..., 0]
        total += ce.sum().item()
        count += ce.size
    return math.exp(total / max(1, count))


def loss_by_position(model: TinyCoder, tokens: np.ndarray, length: int, windows: int,
                     chunk: int, edges: list[int]) -> dict:
    """Mean next-token loss (nats) by position bucket over `windows` windows of `length` tokens.

    Windows start evenly over `tokens` (apart when the stream is long enough) and are fed
    through a KV cache `chunk` tokens at a time, the way the server prefills, so the full
    context's attention never materializes at once. The loss at position i predicts token
    i + 1 from tokens 0..i. Buckets are [edges[j], edges[j+1]); returns {"length", "windows",
    "starts", "buckets": [{"from", "to", "loss", "ppl"}]}.
    """
    if tokens.size < length + 1:
        raise ValueError(f"{tokens.size} held-out tokens cannot fill a {length}-token window")
    starts = np.linspace(0, tokens.size - length - 1, windows).astype(np.int64)
    x = mx.array(np.stack([tokens[s:s + length + 1] for s in starts]).astype(np.int32))
    cache = make_prompt_cache(model)
    per_pos = []
    for s in range(0, length, chunk):
        e = min(length, s + chunk)
        logits = model(x[:, s:e], cache=cache).astype(mx.float32)
        ce = mx.logsumexp(logits, axis=-1) - mx.take_along_axis(logits, x[:, s + 1:e + 1, None], -1)[..., 0]
        per_pos.append(ce.mean(axis=0))
        mx.eval(per_pos[-1])
    losses = np.array(mx.concatenate(per_pos))
    return {"length": length, "windows": windows, "starts": starts.tolist(),
            "buckets": bucket_losses(losses, edges)}


def bucket_losses(losses: np.ndarray, edges: list[int]) -> list[dict]:
    """Mean loss (nats) and perplexity of per-position `losses` over [edges[j], edges[j+1])."""
    out = []
    for lo, hi in zip(edges, edges[1:]):
        value = float(losses[lo:hi].mean())
        out.append({"from": lo, "to": hi, "loss": round(value, 4), "ppl": round(math.exp(value), 3)})
    return out


def _sample(logits: mx.array, temperature: float) -> mx.array:
    if temperature == 0:
        return mx.argmax(logits, axis=-1)
    return mx.random.categorical(logits / temperature)


def generate_batch(model: TinyCoder, prompts: np.ndarray, new_tokens: int, temperature: float) -> np.ndarray:
    """Continue each equal-length prompt by `new_tokens` trunk tokens; returns [B, P + new]."""
    cache = make_prompt_cache(model)
    x = mx.array(prompts.astype(np.int32))
    logits = model(x, cache=cache)[:, -1, :].astype(mx.float32)
    out = [x]
    for _ in range(new_tokens):
        tok = _sample(logits, temperature)[:, None]
        out.append(tok)
        logits = model(tok, cache=cache)[:, -1, :].astype(mx.float32)
    return np.array(mx.concatenate(out, axis=1))


def _step_acceptance(p_logits: mx.array, q_logits: mx.array, temperature: float) -> mx.array:
    if temperature == 0:
        return (mx.argmax(p_logits, -1) == mx.argmax(q_logits, -1)).astype(mx.float32)
    p = mx.softmax(p_logits / temperature, axis=-1)
    q = mx.softmax(q_logits / temperature, axis=-1)
    return mx.minimum(p, q).sum(-1)


def acceptance(model: TinyCoder, heldout: np.ndarray, depth: int, temperature: float, *,
               prompts: int = 32, prompt_len: int = 128, new_tokens: int = 128, seed: int = 0) -> dict:
    """Acceptance by depth on held-out code at `temperature` (see module docstring).

    Returns {"temperature", "depth", "cumulative": [P(steps 1..k all accepted)],
    "conditional": [P(step k accepted | 1..k-1 accepted)], "mean_accepted_length": {D: value}}
    where mean accepted length counts the verify's own token (AR = 1.0).
    """
    rng = np.random.default_rng(seed)
    mx.random.seed(seed)
    starts = rng.integers(0, heldout.size - prompt_len - 1, size=prompts)
    batch = np.stack([heldout[s:s + prompt_len] for s in starts])
    seq = mx.array(generate_batch(model, batch, new_tokens, temperature).astype(np.int32))
    h = model.hidden(seq)
    p_logits = model.logits_from_hidden(h).astype(mx.float32)
    total = seq.shape[1]
    # Anchors t: generated region, with room for `depth` more tokens after t+1.
    lo, hi = prompt_len - 1, total - 1 - depth
    feeds = [seq[:, 1 + s:total - depth + s] for s in range(depth)]  # length total-1-depth
    outs = model.mtp_chain(h[:, :total - 1 - depth], feeds)
    survive = mx.ones((seq.shape[0], hi - lo))
    cumulative = []
    for s, g in enumerate(outs):
        q = model.logits_from_hidden(g).astype(mx.float32)[:, lo:hi]
        # Draft step s from anchor t predicts x_{t+2+s}: the trunk's distribution at t+1+s.
        p = p_logits[:, lo + 1 + s:hi + 1 + s]
        survive = survive * _step_acceptance(p, q, temperature)
        cumulative.append(survive.mean().item())
    conditional = [cumulative[0]] + [cumulative[k] / max(cumulative[k - 1], 1e-9)
                                     for k in range(1, depth)]
    return {"temperature": temperature, "depth": depth,
            "cumulative": [round(c, 4) for c in cumulative],
            "conditional": [round(c, 4) for c in conditional],
            "mean_accepted_length": {d: round(1 + sum(cumulative[:d]), 4) for d in range(1, depth + 1)}}


def greedy_complete(model: TinyCoder, prompt_ids: list[int], max_new: int, stop_ids: set[int]) -> list[int]:
    """Greedy trunk continuation of one prompt, ending at (and including) a stop id or max_new."""
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt_ids]), cache=cache)[:, -1, :]
    out: list[int] = []
    for _ in range(max_new):
        tok = int(mx.argmax(logits, axis=-1).item())
        out.append(tok)
        if tok in stop_ids:
            break
        logits = model(mx.array([[tok]]), cache=cache)[:, -1, :]
    return out
