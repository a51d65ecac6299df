"""mtplx-tiny-coder: mlx-lm's dense qwen3 trunk plus one MTP layer, for training and evaluation.

The weight names and the MTP forward follow the engine's contract
(notes "Dense qwen3 MTP layout"):

    g = mtp.norm(layer0(fc(concat[pre_fc_norm_embedding(embed(x_{t+1})), pre_fc_norm_hidden(h_t)])))
    logits = embed_tokens.as_linear(g)          # tied embeddings

`h_t` is the trunk's hidden after its final norm; a deeper draft step feeds `g` back as `h`.
During decoding the MTP layer's KV cache entry j pairs with trunk position j, so draft step s
(0-based) from anchor t sits at position t+s and attends to the step-0 entries of anchors <= t
plus its own chain's entries of steps 1..s. `mtp_chain` computes every anchor's chain in
parallel with exactly that attention pattern, which makes the recursive (depth > 1) training
loss match what the engine does at depth > 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3


@dataclass
class TinyCoderArgs(qwen3.ModelArgs):
    """qwen3 ModelArgs plus the number of MTP layers (always 1 here)."""

    mtp_num_hidden_layers: int = 1


class MTPModule(nn.Module):
    """The `mtp.*` block: two input norms, the 2H->H projection, one decoder layer, a final norm."""

    def __init__(self, args: TinyCoderArgs):
        super().__init__()
        h = args.hidden_size
        self.pre_fc_norm_embedding = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = [qwen3.TransformerBlock(args)]
        self.norm = nn.RMSNorm(h, eps=args.rms_norm_eps)


def _split(x: mx.array, n: int) -> mx.array:
    """[B, L, n*d] -> [B, L, n, d]."""
    b, length, _ = x.shape
    return x.reshape(b, length, n, -1)


def _heads(x: mx.array) -> mx.array:
    """[B, L, n, d] -> [B, n, L, d]."""
    return x.transpose(0, 2, 1, 3)


def _chain_attention(q: mx.array, k0: mx.array, v0: mx.array,
                     chain: list[tuple[mx.array, mx.array]], scale: float,
                     q_offset: int = 0) -> mx.array:
    """Attention of each anchor's query over step-0 keys of anchors <= it plus its own chain keys.

    q: [B, nh, Lq, d] for anchors q_offset..q_offset+Lq-1; k0/v0: [B, nkv, L, d] for every
    anchor; each chain pair: [B, nkv, Lq, d] (the queried anchors'). Returns [B, nh, Lq, d].
    """
    rep = q.shape[1] // k0.shape[1]
    if rep > 1:
        k0, v0 = mx.repeat(k0, rep, axis=1), mx.repeat(v0, rep, axis=1)
        chain = [(mx.repeat(k, rep, axis=1), mx.repeat(v, rep, axis=1)) for k, v in chain]
    qs = (q * scale).astype(mx.float32)
    length = k0.shape[2]
    scores = qs @ k0.astype(mx.float32).swapaxes(-1, -2)
    causal = (mx.arange(q.shape[2]) + q_offset)[:, None] >= mx.arange(length)[None, :]
    scores = mx.where(causal, scores, mx.array(-1e9, mx.float32))
    own = [(qs * k.astype(mx.float32)).sum(-1, keepdims=True) for k, _ in chain]
    probs = mx.softmax(mx.concatenate([scores] + own, axis=-1), axis=-1)
    out = probs[..., :length] @ v0.astype(mx.float32)
    for i, (_, v) in enumerate(chain):
        out = out + probs[..., length + i:length + i + 1] * v.astype(mx.float32)
    return out.astype(q.dtype)


class TinyCoder(qwen3.Model):
    """qwen3.Model (so mlx-lm's generate works on it) with an `mtp` attribute."""

    def __init__(self, args: TinyCoderArgs):
        super().__init__(args)
        self.mtp = MTPModule(args)

    def hidden(self, inputs: mx.array) -> mx.array:
        """Trunk hidden states after the final norm, [B, L, H] (no cache)."""
        return self.model(inputs)

    def logits_from_hidden(self, h: mx.array) -> mx.array:
        """Trunk LM head applied to normed hidden states (shared by the MTP head)."""
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def mtp_chain(self, h: mx.array, next_tokens: list[mx.array], tail: int = 0) -> list[mx.array]:
        """Run the MTP chain from every anchor in parallel; return its normed outputs per step.

        h: trunk hidden [B, L, H] at anchors t. next_tokens[s]: [B, L] token fed at step s from
        anchor t (x_{t+1+s}: the true token in training, the drafted one when drafting).
        Output s predicts x_{t+2+s}. With tail > 0 only the last `tail` anchors draft (outputs
        [B, tail, H]) while still attending to every anchor's step-0 entry: on long windows
        that keeps the head's far-context attention trained at a fraction of the L x L memory.
        """
        layer = self.mtp.layers[0]
        attn = layer.self_attn
        start = h.shape[1] - tail if tail else 0
        k0 = v0 = None
        chain: list[tuple[mx.array, mx.array]] = []
        outs = []
        for step, tokens in enumerate(next_tokens):
            if step:
                tokens = tokens[:, start:]
            emb = self.model.embed_tokens(tokens)
            x = self.mtp.fc(mx.concatenate(
                [self.mtp.pre_fc_norm_embedding(emb), self.mtp.pre_fc_norm_hidden(h)], axis=-1))
            xn = layer.input_layernorm(x)
            q_in = xn[:, start:] if step == 0 else xn
            q = _heads(attn.q_norm(_split(attn.q_proj(q_in), attn.n_heads)))
            k = _heads(attn.k_norm(_split(attn.k_proj(xn), attn.n_kv_heads)))
            v = _heads(_split(attn.v_proj(xn), attn.n_kv_heads))
            # Step s of anchor t sits at position t+s (its KV entry pairs with trunk position t+s).
            q = attn.rope(q, offset=start + step)
            k = attn.rope(k, offset=0 if step == 0 else start + step)
            if step == 0:
                k0, v0 = k, v
                x = x[:, start:]
            else:
                chain.append((k, v))
            o = _chain_attention(q, k0, v0, chain, attn.scale, start)
            b, _, length, _ = o.shape
            x = x + attn.o_proj(o.transpose(0, 2, 1, 3).reshape(b, length, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            h = self.mtp.norm(x)
            outs.append(h)
        return outs

    def sanitize(self, weights: dict) -> dict:
        """Drop an untied lm_head when embeddings are tied; keep mtp.* weights."""
        return super().sanitize(weights)


def joint_loss(model: TinyCoder, window: mx.array, mtp_weights: tuple[float, ...]) -> tuple[mx.array, mx.array]:
    """Next-token CE plus weighted MTP CE for depths 1..len(mtp_weights).

    window: [B, L + 1 + D] tokens (D = len(mtp_weights)). Returns (total loss, per-head losses
    [main, mtp step 1, ...]).
    """
    depth = len(mtp_weights)
    length = window.shape[1] - 1 - depth
    inputs = window[:, :length]
    h = model.hidden(inputs)
    ce = nn.losses.cross_entropy
    main = ce(model.logits_from_hidden(h).astype(mx.float32), window[:, 1:length + 1]).mean()
    losses = [main]
    if depth:
        feeds = [window[:, 1 + s:length + 1 + s] for s in range(depth)]
        outs = model.mtp_chain(h, feeds)
        for s, g in enumerate(outs):
            target = window[:, 2 + s:length + 2 + s]
            losses.append(ce(model.logits_from_hidden(g).astype(mx.float32), target).mean())
    total = main
    for w, l in zip(mtp_weights, losses[1:]):
        total = total + w * l
    return total, mx.stack(losses)
