"""Running one contiguous slice of a trunk's layers, with the masks the family's body builds.

mlx-lm's text models build their masks from the cache of a layer of each kind and then call
every layer with them (`Qwen3Model`, `Qwen3_5TextModel.__call__`); a slice builds them the
same way from its own first cache of each kind. Attention caches of one row all hold the same
offset, so the masks, and therefore every layer's output, equal the unsplit body's (bitwise on
the CPU backend: the layers run the same ops on the same inputs).
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, create_ssm_mask


def run_layers(layers: Sequence[nn.Module], caches: Sequence[Any], hidden: mx.array) -> mx.array:
    """Run `hidden` (1, T, H) through `layers` with their `caches`; return the output hidden."""
    if not layers:
        return hidden
    attention_mask = ssm_mask = None
    first_attention = next((i for i, l in enumerate(layers) if not getattr(l, "is_linear", False)), None)
    first_linear = next((i for i, l in enumerate(layers) if getattr(l, "is_linear", False)), None)
    if first_attention is not None:
        attention_mask = create_attention_mask(hidden, caches[first_attention])
    if first_linear is not None:
        ssm_mask = create_ssm_mask(hidden, caches[first_linear])
    for layer, cache in zip(layers, caches):
        mask = ssm_mask if getattr(layer, "is_linear", False) else attention_mask
        hidden = layer(hidden, mask=mask, cache=cache)
    return hidden
