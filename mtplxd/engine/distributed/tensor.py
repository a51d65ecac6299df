"""Tensor parallel serving: every rank holds every layer, split with the family's `shard()`.

mlx-lm's `Model.shard(group)` (qwen3) splits each layer's attention by heads (q/k/v_proj
all-to-sharded, o_proj sharded-to-all) and its MLP by the intermediate size (gate/up
all-to-sharded, down sharded-to-all); the embedding, the final norm and lm_head stay whole.
So each layer ends in an all_sum and every rank holds the same hidden after it. Rank 0 runs
the engine, the embedding, lm_head and the MTP head exactly as one process does; each trunk
forward is announced to the workers (pipeline.TensorTrunk, link.forward_together) so theirs
run in lockstep. all_sum adds the ranks' partial sums in another order than one matmul
does: logits are equal to float rounding, not bitwise (docs/distributed.md has the figure).
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from mtplxd.engine.model.families import FamilySpec

# Families whose shard() is tested here (greedy output equal to one process). qwen3_5 and
# qwen3_5_moe have a shard() in mlx-lm too, untested with our rollback caches; qwen3_next
# has none.
TENSOR_FAMILIES = ("qwen3",)


def tensor_refusal(family: str, config: dict[str, Any], ranks: int) -> str | None:
    """Why `family` with `config` cannot be served tensor parallel over `ranks`, or None."""
    if family not in TENSOR_FAMILIES:
        return (f"tensor parallel serving covers {', '.join(TENSOR_FAMILIES)} only, not "
                f"{family} (its layers are not split by a tested shard()); "
                'set "parallel": "pipeline" in the host file')
    text = config.get("text_config") or config
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = int(text.get(key) or 0)
        if value % ranks:
            return (f"tensor parallel splits {key} ({value}) across the ranks, and {value} is "
                    f"not a multiple of {ranks}; use another number of hosts or "
                    '"parallel": "pipeline"')
    return None


def split_for_tensor(spec: FamilySpec, group: mx.distributed.Group) -> Callable[[nn.Module], None]:
    """A `load_model(shard=...)` hook giving this rank its part of every layer (the lazily
    opened checkpoint is sliced before it is read: a rank reads only its part)."""
    def shard(model: nn.Module) -> None:
        spec.text_model(model).shard(group)
        mx.eval(model.parameters())
    return shard
