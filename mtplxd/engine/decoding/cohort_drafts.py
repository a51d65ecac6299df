"""A cohort's drafting: the MTP heads of all its rows run as one batched forward per step.

A row drafting alone calls its head K+1 times a cycle (the PENDING pass, then K-1 chained
steps) and lm_head K times; W rows alone make W times as many small forwards, which is what a
launch-bound GPU pays for. Here the rows go together: one PENDING pass (right-padded to the
longest row's PENDING, each row's attention over its own pairs and its own head cache:
model/batched.batched_head), then per depth step one draft-logits matmul and one head step
for every row still drafting. Rows of different depths share the steps while they last.

Each row still decides its own drafts (DraftPicker: its penalties, its seed, its q), and a
greedy row without penalties takes its draft from one argmax over all such rows (argmax is
exact, so the same token). On a row-alone BLAS (MLX's bundled CPU BLAS) the drafts and q are
bitwise the solo ones; elsewhere they may round apart, which moves acceptance (and a seeded
sampled row's draws), never the target distribution. A row whose PENDING is longer than a
cycle's (its first cycle: the whole prompt) runs that pass alone, in the solo code's chunks.
"""

from __future__ import annotations

import mlx.core as mx

from mtplxd.engine.decoding.cohort_rows import DraftCall
from mtplxd.engine.decoding.speculative import DraftPicker, Drafted
from mtplxd.engine.model.batched import batched_head, pad_to


def draft_together(calls: list[DraftCall], width: int) -> list[Drafted]:
    """Every call's Drafted (as `decoder.prepare(call)` gives it), the heads run as one
    batch of `width` rows (rows past the calls are padding, their outputs discarded)."""
    decoders = [call.decoder for call in calls]
    trunk, head = decoders[0].trunk, decoders[0].head
    head_starts = [decoder.head_cache[0].offset for decoder in decoders]
    g = _pending_pass(calls, width)
    pickers = [decoder.draft_picker(call.n) for decoder, call in zip(decoders, calls)]
    drafts: list[list[mx.array]] = [[] for _ in calls]
    for i in range(1, max(decoder.depth for decoder in decoders) + 1):
        picks, shared = _pick(pickers, trunk.draft_logits(g), i, [d.depth >= i for d in decoders])
        for row, d in enumerate(picks):
            if d is not None:
                drafts[row].append(d)
        going = [decoder.depth > i for decoder in decoders]
        if any(going):
            # Rows done drafting (and padding) ride along as padding: no cache, output unused.
            if shared is not None and len(shared) == width:  # every row greedy: no gather
                tokens = shared
            else:
                tokens = mx.concatenate(_filled(picks) + [mx.zeros((width - len(calls),), mx.uint32)])
            caches = [decoder.head_cache if go else None for decoder, go in zip(decoders, going)]
            g = batched_head(head, g, trunk.embed(tokens[:, None]),
                             caches + [None] * (width - len(calls)), [1] * width)
    drafted = []
    for call, start, picker, row in zip(calls, head_starts, pickers, drafts):
        stacked = mx.concatenate(row)
        block = mx.concatenate([mx.array([call.token], dtype=stacked.dtype), stacked])[None]
        drafted.append(Drafted(start, start + len(call.pending_tokens), stacked, picker.q_rows, block))
    return drafted


def _pending_pass(calls: list[DraftCall], width: int) -> mx.array:
    """The head over each row's PENDING pairs: each row's last g, as (width, 1, H)."""
    decoders = [call.decoder for call in calls]
    padding = width - len(calls)
    lengths = [len(call.pending_tokens) for call in calls]
    together = [n <= d.depth + 1 for n, d in zip(lengths, decoders)]
    longest = max([n for n, joins in zip(lengths, together) if joins], default=0)
    batch = None
    if longest:
        size, dtype = calls[0].pending_h.shape[-1], calls[0].pending_h.dtype
        hidden = mx.concatenate(
            [pad_to(call.pending_h, longest, axis=1) if joins else mx.zeros((1, longest, size), dtype)
             for call, joins in zip(calls, together)] + [mx.zeros((padding, longest, size), dtype)])
        tokens = mx.array([call.pending_tokens + [0] * (longest - n) if joins else [0] * longest
                           for call, n, joins in zip(calls, lengths, together)]
                          + [[0] * longest] * padding)
        caches = [d.head_cache if joins else None for d, joins in zip(decoders, together)]
        batch = batched_head(decoders[0].head, hidden, decoders[0].trunk.embed(tokens),
                             caches + [None] * padding,
                             [n if joins else 1 for n, joins in zip(lengths, together)] + [1] * padding)
    if all(together):
        last = mx.array(lengths + [1] * padding) - 1
        return batch[mx.arange(width), last][:, None, :]
    rows = [batch[i:i + 1, n - 1:n] if joins else call.decoder.first_draft_hidden(call)
            for i, (call, n, joins) in enumerate(zip(calls, lengths, together))]
    pad = mx.zeros((padding, 1, rows[0].shape[-1]), rows[0].dtype)
    return mx.concatenate(rows + [pad])


def _pick(pickers: list[DraftPicker], logits: mx.array, i: int,
          drafting: list[bool]) -> tuple[list[mx.array | None], mx.array | None]:
    """Draft i of every row still drafting, as (1,) arrays (None for the others): greedy rows
    without penalties from one argmax, the others from their own pickers. Also that argmax
    over all (width) rows when every row is such a greedy row (else None): the next step's
    tokens as they are (padding rows' tokens are never read)."""
    plain = [p.params.greedy and not p.params.has_penalties for p in pickers]
    argmax = mx.argmax(logits[:, 0].astype(mx.float32), axis=-1) if any(plain) else None
    picks: list[mx.array | None] = []
    for row, (picker, go) in enumerate(zip(pickers, drafting)):
        if not go:
            picks.append(None)
        elif plain[row]:
            picks.append(argmax[row:row + 1])
        else:
            picks.append(picker.pick(logits[row], i))
    return picks, argmax if all(plain) else None


def _filled(picks: list[mx.array | None]) -> list[mx.array]:
    return [mx.zeros((1,), mx.uint32) if d is None else d.astype(mx.uint32) for d in picks]
