"""The MTP head: one extra decoder layer that predicts token t+2 from (h_t, x_{t+1}).

g = norm(layer(fc(concat[pre_fc_norm_embedding(embed(x_{t+1})), pre_fc_norm_hidden(h_t)])))
Embedding first, then hidden (vLLM's order, which matches the checkpoint's fc layout). The
embedding and lm_head are the trunk's; chained steps feed the normed output g back as h.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache


class MTPHead(nn.Module):
    """Parameter names match the checkpoint's `mtp.*` tensors (fc, norms, layers.0.*)."""

    def __init__(self, hidden_size: int, eps: float, layer: nn.Module) -> None:
        super().__init__()
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden_size, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden_size, eps=eps)
        self.layers = [layer]
        self.norm = nn.RMSNorm(hidden_size, eps=eps)

    def __call__(self, hidden: mx.array, embeddings: mx.array, cache: list[Any]) -> mx.array:
        """Run the head over (B, L) pairs; returns the normed output g (B, L, H).

        `cache[0]` is the layer's KV cache; its offset is the absolute position of the
        first pair (entry j pairs trunk hidden j with token j+1).
        """
        x = mx.concatenate(
            [self.pre_fc_norm_embedding(embeddings), self.pre_fc_norm_hidden(hidden)], axis=-1
        )
        x = self.fc(x)
        mask = create_attention_mask(x, cache[0])
        x = self.layers[0](x, mask, cache[0])
        return self.norm(x)

    def make_cache(self) -> list[Any]:
        """A fresh cache for the head's own attention layer."""
        return [KVCache()]


MTP_NORM_SUFFIXES = (
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "q_norm.weight",
    "k_norm.weight",
)


def is_mtp_norm(name: str) -> bool:
    """True for the zero-centred RMSNorm gains of the MTP block (all 7 of them)."""
    return name == "mtp.norm.weight" or name.endswith(MTP_NORM_SUFFIXES)
