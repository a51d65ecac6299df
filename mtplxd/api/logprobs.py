"""Generated tokens' logprobs in each dialect's shape (the engine computes them:
engine/decoding/logprobs.py).

A token is shown as its text and its exact bytes: a byte-level BPE token can be part of a
UTF-8 character, so its `token` text uses U+FFFD for the missing part and `bytes` keeps the
truth (OpenAI's convention). Chat completions: `choices[].logprobs.content`, one entry per
token with `top_logprobs`; legacy completions: `tokens`, `token_logprobs`, `top_logprobs`
(one {token: logprob} object per position) and `text_offset`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mtplxd.engine.interface import TokenLogprob


@dataclass
class Piece:
    """A token as text and bytes."""

    text: str
    bytes: list[int]


@dataclass
class Scored:
    """A TokenLogprob with its token and alternatives shown."""

    token: int
    piece: Piece
    logprob: float
    top: list[tuple[Piece, float]]


@dataclass
class LogprobItems:
    """A streamed delta's logprobs (sent next to, or ahead of, its text)."""

    entries: list[TokenLogprob]


def token_pieces(model: Any, token_ids: list[int]) -> dict[int, Piece]:
    """Text and bytes of each distinct token id (tokenizer work: run off the owner thread)."""
    tokenizer = model.tokenizer
    decoder = _byte_decoder(tokenizer)
    pieces: dict[int, Piece] = {}
    for token in set(token_ids):
        raw = None
        if decoder is not None:
            symbol = tokenizer.convert_ids_to_tokens(token)
            if isinstance(symbol, str) and all(c in decoder for c in symbol):
                raw = bytes(decoder[c] for c in symbol)
        if raw is None:  # an added token, or not a byte-level vocabulary: its decoded text
            raw = tokenizer.decode([token]).encode()
        pieces[token] = Piece(raw.decode("utf-8", errors="replace"), list(raw))
    return pieces


def _byte_decoder(tokenizer: Any) -> dict[str, int] | None:
    """GPT-2's byte-level symbol -> byte map, when the vocabulary is byte-level BPE."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, _byte_decoder

    if isinstance(getattr(tokenizer, "_detokenizer", None), BPEStreamingDetokenizer):
        return _byte_decoder()
    return None


def ids_of(entries: list[TokenLogprob]) -> list[int]:
    """Every token id `entries` show (chosen and alternatives)."""
    return [e.token for e in entries] + [t for e in entries for t, _ in e.top]


def scored(entries: list[TokenLogprob], pieces: dict[int, Piece]) -> list[Scored]:
    """`entries` with their tokens shown."""
    return [Scored(e.token, pieces[e.token], _finite(e.logprob), [(pieces[t], _finite(v)) for t, v in e.top])
            for e in entries]


def _finite(value: float) -> float:
    """JSON has no -inf: a token the penalties ruled out is shown as -9999 (OpenAI's floor)."""
    return value if math.isfinite(value) else -9999.0


def chat_content(items: list[Scored]) -> list[dict[str, Any]]:
    """Chat completions' `logprobs.content`."""
    return [{"token": s.piece.text, "logprob": s.logprob, "bytes": s.piece.bytes,
             "top_logprobs": [{"token": p.text, "logprob": v, "bytes": p.bytes} for p, v in s.top]}
            for s in items]


def _by_text(top: list[tuple[Piece, float]]) -> dict[str, float]:
    """Alternatives keyed by text; two tokens with the same text (parts of one character)
    keep the better logprob (they come best first)."""
    out: dict[str, float] = {}
    for piece, value in top:
        out.setdefault(piece.text, value)
    return out


def completion_logprobs(items: list[Scored], offset: int) -> dict[str, Any]:
    """Legacy completions' `logprobs` for `items`, the first starting at character `offset`
    (`top_logprobs`: one {token: logprob} object per position, empty with `logprobs: 0`)."""
    offsets, position = [], offset
    for s in items:
        offsets.append(position)
        position += len(s.piece.text)
    return {"tokens": [s.piece.text for s in items], "token_logprobs": [s.logprob for s in items],
            "top_logprobs": [_by_text(s.top) for s in items],
            "text_offset": offsets, "token_ids": [s.token for s in items]}
