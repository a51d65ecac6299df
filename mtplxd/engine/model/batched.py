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

The hybrid family (Qwen3.5/3.6, Qwen3-Next: Gated DeltaNet layers between gated-attention
layers) batches its norms, MLP (or MoE block) and lm_head; each row's token mixer (a
DeltaNet layer with its conv and recurrent state, or a gated attention with its KV) runs
per row, as mlx-lm's own module on that row's slice with that row's cache and mask.

The MTP head (one decoder layer) drafts for a cohort the same way (`batched_head`): its fc,
norms and MLP batched, its attention per row on the row's own head cache. Its PENDING pass
is ragged (each row accepted a different number of drafts), so rows are right-padded to the
longest and each row's attention sees only its own `lengths[i]` positions: padding never
enters a cache, and its outputs are discarded.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.base import (
    create_attention_mask, create_ssm_mask, scaled_dot_product_attention,
)

from mtplxd.engine.model import qk_norm_rope
from mtplxd.engine.model.trunk import Trunk


def batched_supported(trunk: Trunk) -> bool:
    """True when the trunk's body can run `batched_forward`: dense qwen3, or a hybrid body
    (Qwen3.5/3.6, Qwen3-Next) that is not split over a pipeline."""
    if trunk.text is None:
        return False
    body = trunk.text.model
    if _is_dense_body(body):
        return all(_is_dense_block(layer) for layer in body.layers)
    return _is_hybrid_body(body) and getattr(body, "pipeline_size", 1) == 1


def batched_forward(trunk: Trunk, tokens: mx.array, caches: list[list[Any] | None],
                    lengths: list[int] | None = None, *,
                    last_logits: bool = False) -> tuple[mx.array, mx.array]:
    """Run (W, L) tokens, row i on `caches[i]` (None: a padding row whose output is unused);
    return (post-norm hidden (W, L, H), logits (W, L, V)). Every live row's cache advances by
    L exactly as `trunk.forward` on that row alone would advance it. With `lengths`, row i's
    tokens are its first lengths[i] (right-padded: rows of different depths in one verify,
    prefill chunks of different lengths): its cache advances by lengths[i] and only those
    positions of its output are its own. With `last_logits`, logits are (W, 1, V): each
    row's last own position only (a prefill never materialises the (L, vocab) rows)."""
    body = trunk.text.model
    h = body.embed_tokens(tokens)
    if _is_dense_body(body):
        masks = _row_masks(h, caches, 0, create_attention_mask, lengths)
        for index, layer in enumerate(body.layers):
            h = _dense_block(layer, h, masks, _layer_caches(caches, index), lengths)
    else:
        # The model's own rule: attention layers share one mask, DeltaNet layers another.
        fa_masks = _row_masks(h, caches, body.fa_idx, create_attention_mask, lengths)
        ssm_masks = _row_masks(h, caches, body.ssm_idx, create_ssm_mask, lengths)
        for index, layer in enumerate(body.layers):
            masks = ssm_masks if layer.is_linear else fa_masks
            h = _hybrid_block(layer, h, masks, _layer_caches(caches, index), lengths)
    hidden = body.norm(h)
    if last_logits:
        ends = lengths or [hidden.shape[1]] * hidden.shape[0]
        return hidden, trunk.lm_head(mx.concatenate([hidden[i:i + 1, n - 1:n] for i, n in enumerate(ends)]))
    return hidden, trunk.lm_head(hidden)


def batched_head(head: Any, hidden: mx.array, embeddings: mx.array,
                 caches: list[list[Any] | None], lengths: list[int]) -> mx.array:
    """MTPHead.__call__ over (W, L) pairs, row i on its head cache `caches[i]` (None: a
    padding row) with its first `lengths[i]` pairs real; returns g (W, L, H), of which each
    row's first `lengths[i]` positions are what the head gives that row alone."""
    x = mx.concatenate([head.pre_fc_norm_embedding(embeddings), head.pre_fc_norm_hidden(hidden)],
                       axis=-1)
    x = head.fc(x)
    layer = head.layers[0]
    layer_caches = _layer_caches(caches, 0)
    masks = _row_masks(x, caches, 0, create_attention_mask, lengths)
    if _is_dense_block(layer):
        x = _dense_block(layer, x, masks, layer_caches, lengths)
    else:
        x = _hybrid_block(layer, x, masks, layer_caches, lengths)
    return head.norm(x)


def _row_masks(h: mx.array, caches: list[list[Any] | None], index: int | None,
               make: Any, lengths: list[int] | None = None) -> list[Any]:
    if index is None:
        return [None] * len(caches)
    ends = lengths or [h.shape[1]] * len(caches)
    return [None if cache is None else make(h[i:i + 1, :ends[i]], cache[index])
            for i, cache in enumerate(caches)]


def _layer_caches(caches: list[list[Any] | None], index: int) -> list[Any | None]:
    return [None if cache is None else cache[index] for cache in caches]


def _is_dense_body(body: Any) -> bool:
    from mlx_lm.models.qwen3 import Qwen3Model

    return type(body) is Qwen3Model


def _is_hybrid_body(body: Any) -> bool:
    from mlx_lm.models.qwen3_5 import Qwen3_5TextModel
    from mlx_lm.models.qwen3_next import Qwen3NextModel

    return type(body) in (Qwen3_5TextModel, Qwen3NextModel)


def _is_dense_block(layer: Any) -> bool:
    from mlx_lm.models.qwen3 import TransformerBlock

    return type(layer) is TransformerBlock


def pad_to(row: mx.array, length: int, axis: int) -> mx.array:
    """`row` with zeros appended along `axis` up to `length` (a ragged row back in the batch)."""
    missing = length - row.shape[axis]
    if missing == 0:
        return row
    shape = list(row.shape)
    shape[axis] = missing
    return mx.concatenate([row, mx.zeros(shape, row.dtype)], axis=axis)


def _dense_block(layer: Any, x: mx.array, masks: list[Any], caches: list[Any | None],
                 lengths: list[int] | None = None) -> mx.array:
    """qwen3's TransformerBlock with its projections batched and its attention per row (the
    ops and their order are mlx-lm's own, so a row's numbers are its solo numbers). With
    `lengths`, row i attends over (and caches) only its first lengths[i] positions."""
    attn = layer.self_attn
    B, L, _ = x.shape
    normed = layer.input_layernorm(x)
    queries, keys, values = attn.q_proj(normed), attn.k_proj(normed), attn.v_proj(normed)
    # A layer whose norms and rope are one kernel (qk_norm_rope.py) runs it row by row, as
    # the row's solo forward does; mlx-lm's layer norms the batch, then ropes each row.
    one_kernel = isinstance(attn, qk_norm_rope.NormRopeAttention)
    if not one_kernel:
        queries = attn.q_norm(queries.reshape(B, L, attn.n_heads, -1)).transpose(0, 2, 1, 3)
        keys = attn.k_norm(keys.reshape(B, L, attn.n_kv_heads, -1)).transpose(0, 2, 1, 3)
    values = values.reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    outputs = []
    for i, cache in enumerate(caches):
        if cache is None:  # a padding row: its attention is skipped, its output discarded
            outputs.append(mx.zeros((1, attn.n_heads, L, values.shape[-1]), queries.dtype))
            continue
        n = L if lengths is None else lengths[i]
        if one_kernel:
            q, k = qk_norm_rope.norm_rope(attn, queries[i:i + 1, :n], keys[i:i + 1, :n], cache.offset)
        else:
            q = attn.rope(queries[i:i + 1, :, :n], offset=cache.offset)
            k = attn.rope(keys[i:i + 1, :, :n], offset=cache.offset)
        k, v = cache.update_and_fetch(k, values[i:i + 1, :, :n])
        attended = scaled_dot_product_attention(q, k, v, cache=cache, scale=attn.scale,
                                                mask=masks[i])
        outputs.append(pad_to(attended, L, axis=2))
    attended = mx.concatenate(outputs, axis=0).transpose(0, 2, 1, 3).reshape(B, L, -1)
    h = x + attn.o_proj(attended)
    return h + layer.mlp(layer.post_attention_layernorm(h))


def _hybrid_block(layer: Any, x: mx.array, masks: list[Any], caches: list[Any | None],
                  lengths: list[int] | None = None) -> mx.array:
    """A hybrid decoder layer: norms and MLP batched, the token mixer per row (mlx-lm's
    DecoderLayer order: x + mixer(norm(x)), then h + mlp(norm(h))). With `lengths`, row i's
    mixer sees only its first lengths[i] positions."""
    mixer = layer.linear_attn if layer.is_linear else layer.self_attn
    normed = layer.input_layernorm(x)
    L = x.shape[1]
    rows = []
    for i, cache in enumerate(caches):
        if cache is None:
            rows.append(mx.zeros_like(normed[i:i + 1]))
            continue
        n = L if lengths is None else lengths[i]
        rows.append(pad_to(mixer(normed[i:i + 1, :n], masks[i], cache), L, axis=1))
    h = x + mx.concatenate(rows, axis=0)
    return h + layer.mlp(layer.post_attention_layernorm(h))
