"""Tensor parallel serving: every rank holds every layer, split with the family's `shard()`.

mlx-lm's `Model.shard(group)` splits each layer's attention by heads (q/k/v_proj
all-to-sharded, o_proj sharded-to-all) and its MLP by the intermediate size (gate/up
all-to-sharded, down sharded-to-all; a MoE block each expert's MLP); for the hybrid qwen3_5
(and qwen3_5_moe) it also splits each Gated
DeltaNet layer by heads (in_proj_qkv/z/a/b, the depthwise conv1d, A_log and dt_bias by head,
out_proj sharded-to-all), so each rank's rollback cache holds the conv and recurrent state of
its own heads and trims it locally (rollback.py). Every layer ends in an all_sum and every
rank holds the same hidden after it. The embedding, the final norm and lm_head stay whole on
rank 0, which runs the engine, the embedding, lm_head and the MTP head exactly as one process
does; each trunk forward (and the rows' trims) is announced to the workers
(pipeline.TensorTrunk, link.forward_together) so theirs run in lockstep. Workers drop the
ends they never use (shard.drop_ends). all_sum adds the ranks' partial sums in another order
than one matmul does: logits are equal to float rounding, not bitwise (docs/distributed.md
has the figures).
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from mtplxd.engine.distributed.shard import drop_ends
from mtplxd.engine.model.families import FamilySpec

# Families whose shard() is tested here (greedy output equal to one process: qwen3 and
# qwen3_5 with 2 and 3 ranks, qwen3_5_moe with 2). qwen3_next has no shard() in mlx-lm.
TENSOR_FAMILIES = ("qwen3", "qwen3_5", "qwen3_5_moe")
# What shard() divides by the number of ranks, per family (a MoE layer splits every expert's
# and the shared expert's MLP; its router stays whole).
_ATTENTION = ("num_attention_heads", "num_key_value_heads")
_GATED_DELTANET = ("linear_num_key_heads", "linear_num_value_heads")
SPLIT_KEYS = {
    "qwen3": _ATTENTION + ("intermediate_size",),
    "qwen3_5": _ATTENTION + _GATED_DELTANET + ("intermediate_size",),
    "qwen3_5_moe": _ATTENTION + _GATED_DELTANET + ("moe_intermediate_size",
                                                   "shared_expert_intermediate_size"),
}


def tensor_refusal(family: str, config: dict[str, Any], ranks: int) -> str | None:
    """Why `family` with `config` cannot be served tensor parallel over `ranks`, or None."""
    if family not in TENSOR_FAMILIES:
        return (f"tensor parallel serving covers {', '.join(TENSOR_FAMILIES)} only, not "
                f"{family} (its layers are not split by a tested shard()); "
                'set "parallel": "pipeline" in the host file')
    text = config.get("text_config") or config
    for key in SPLIT_KEYS[family]:
        value = int(text.get(key) or 0)
        if value % ranks:
            return (f"tensor parallel splits {key} ({value}) across the ranks, and {value} is "
                    f"not a multiple of {ranks}; use another number of hosts or "
                    '"parallel": "pipeline"')
    return None


def split_for_tensor(spec: FamilySpec, group: mx.distributed.Group, *,
                     ends: bool) -> Callable[[nn.Module], None]:
    """A `load_model(shard=...)` hook giving this rank its part of every layer (the lazily
    opened checkpoint is sliced before it is read: a rank reads only its part). With `ends`
    (rank 0) the embedding, final norm, lm_head and MTP head are kept whole; without, they are
    dropped unread."""
    def shard(model: nn.Module) -> None:
        if not ends:
            drop_ends(spec, model)
        split_layers(spec, model, group)
        mx.eval(model.parameters())
    return shard


def split_layers(spec: FamilySpec, model: nn.Module, group: mx.distributed.Group) -> None:
    """Run the family's `shard(group)` on the layers only, leaving lm_head whole.

    qwen3_5's shard() also splits an untied lm_head by vocabulary (each rank computing a slice
    that is gathered after). mtplx keeps lm_head whole on rank 0, where the sampler and the MTP
    head read it, so while shard() runs the head reads as tied and shard() leaves it alone."""
    text = spec.text_model(model)
    args = text.args
    untied = not getattr(args, "tie_word_embeddings", False)
    if untied:
        args.tie_word_embeddings = True
    try:
        model.shard(group)
    finally:
        if untied:
            args.tie_word_embeddings = False
