"""Streaming text out of committed tokens: UTF-8 safe, with stop strings held back.

mlx-lm's streaming detokenizer already waits for a multi-byte character to be complete.
On top of it this keeps back the tail of the text that could still become a stop string, so
a stop string never reaches the client, not even in part.
"""

from __future__ import annotations


class TextStream:
    """Feed tokens one at a time; get the text that is safe to emit now."""

    def __init__(self, tokenizer, stop_strings: list[str]) -> None:
        self._detok = tokenizer.detokenizer  # a fresh, reset streaming detokenizer
        self._stops = [s for s in stop_strings if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._emitted = 0  # characters of the detokenizer's text already handed out
        self.stopped = False
        self.text = ""  # everything handed out so far

    def add(self, token_id: int) -> str:
        """Add a token; return the new emittable text ("" while a char or stop is pending).

        After a stop string completes, `stopped` is True and the text before it is returned.
        """
        if self.stopped:
            return ""
        self._detok.add_token(token_id)
        return self._release(final=False)

    def finish(self) -> str:
        """Flush what is left (the stream ended); return the last piece of text."""
        if self.stopped:
            return ""
        self._detok.finalize()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        full = self._detok.text
        if self._stops:
            search_from = max(0, self._emitted - self._hold)
            hits = [i for i in (full.find(s, search_from) for s in self._stops) if i >= 0]
            if hits:
                self.stopped = True
                return self._emit(full, min(hits))
        limit = len(full) if final else self._safe_limit(full)
        return self._emit(full, limit)

    def _safe_limit(self, full: str) -> int:
        """Keep back the longest tail that is a prefix of some stop string."""
        for size in range(min(self._hold, len(full)), 0, -1):
            tail = full[len(full) - size:]
            if any(s.startswith(tail) for s in self._stops):
                return len(full) - size
        return len(full)

    def _emit(self, full: str, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        piece = full[self._emitted:upto]
        self._emitted = upto
        self.text += piece
        return piece
