"""One target forward over several rows that each keep their own cache (a cohort's verify).

Rows of a cohort sit at different context lengths (each accepted a different number of
drafts every cycle), so they cannot share one left-padded cache without re-padding it every
cycle. Instead each row keeps its own trunk cache, exactly as when it decodes alone, and the
forward splits work by what depends on the row:
  - batched over all rows: embeddings, RMSNorms, the q/k/v and o projections, the MLP and
    lm_head (the weight reads, which are what a small-batch decode step pays for);
  - per row: RoPE at the row's own offset, its cache update, its causal mask and attention.
Per-row attention is the same computation as the row's solo forward, and every batched op
computes each row alone on backends whose matmuls do (MLX's bundled CPU BLAS). Elsewhere
(OpenBLAS, CUDA) a matmul over more rows may round differently: the `numerics` setting
(cohort.py) chooses between these batched forwards and per-row ones.

Only dense qwen3 bodies run here (`batched_supported`); the hybrid family's rows (Gated
DeltaNet conv/recurrent state, gated attention) are verified with per-row forwards inside
their cohort (cohort.py), which is correct for any family but batches nothing.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention

from mtplxd.engine.model.trunk import Trunk


def batched_supported(trunk: Trunk) -> bool:
    """True when the trunk's body can run `batched_forward` (a registered family's text model
    whose forward is embed -> layers(h, mask, cache) -> norm, as dense qwen3's)."""
    if trunk.text is None:
        return False
    from mlx_lm.models.qwen3 import Qwen3Model

    body = trunk.text.model
    return type(body) is Qwen3Model and all(_is_dense_block(layer) for layer in body.layers)


def batched_forward(trunk: Trunk, tokens: mx.array,
                    caches: list[list[Any] | None]) -> tuple[mx.array, mx.array]:
    """Run (W, L) tokens, row i on `caches[i]` (None: a padding row whose output is unused);
    return (post-norm hidden (W, L, H), logits (W, L, V)). Every live row's cache advances by
    L exactly as `trunk.forward` on that row alone would advance it."""
    body = trunk.text.model
    h = body.embed_tokens(tokens)
    masks = [None if cache is None else create_attention_mask(h[i:i + 1], cache[0])
             for i, cache in enumerate(caches)]
    for index, layer in enumerate(body.layers):
        layer_caches = [None if cache is None else cache[index] for cache in caches]
        h = _dense_block(layer, h, masks, layer_caches)
    hidden = body.norm(h)
    return hidden, trunk.lm_head(hidden)


def _is_dense_block(layer: Any) -> bool:
    from mlx_lm.models.qwen3 import TransformerBlock

    return type(layer) is TransformerBlock


def _dense_block(layer: Any, x: mx.array, masks: list[Any],
                 caches: list[Any | None]) -> mx.array:
    """qwen3's TransformerBlock with its projections batched and its attention per row (the
    ops and their order are mlx-lm's own, so a row's numbers are its solo numbers)."""
    attn = layer.self_attn
    B, L, _ = x.shape
    normed = layer.input_layernorm(x)
    queries, keys, values = attn.q_proj(normed), attn.k_proj(normed), attn.v_proj(normed)
    queries = attn.q_norm(queries.reshape(B, L, attn.n_heads, -1)).transpose(0, 2, 1, 3)
    keys = attn.k_norm(keys.reshape(B, L, attn.n_kv_heads, -1)).transpose(0, 2, 1, 3)
    values = values.reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    outputs = []
    for i, cache in enumerate(caches):
        q = queries[i:i + 1]
        if cache is None:  # a padding row: its attention is skipped, its output discarded
            outputs.append(mx.zeros_like(q))
            continue
        q = attn.rope(q, offset=cache.offset)
        k = attn.rope(keys[i:i + 1], offset=cache.offset)
        k, v = cache.update_and_fetch(k, values[i:i + 1])
        outputs.append(scaled_dot_product_attention(q, k, v, cache=cache, scale=attn.scale,
                                                    mask=masks[i]))
    attended = mx.concatenate(outputs, axis=0).transpose(0, 2, 1, 3).reshape(B, L, -1)
    h = x + attn.o_proj(attended)
    return h + layer.mlp(layer.post_attention_layernorm(h))
