"""Log-probabilities of the tokens a request committed, from the target model alone.

A request that asks for logprobs gets a scorer with its own trunk cache: each delta's
committed tokens are fed through the target, and every token's log-probability is read from
the target's distribution at its position after the request's penalties (the same
`apply_penalties` the sampler uses, with the history of that exact position), before
temperature and top-p/top-k/min-p (as OpenAI's logprobs are). The drafter's q never enters:
the scorer does not know whether the tokens came from AR steps or MTP cycles, so AR and MTP
report the same values for the same tokens. The cost is one more target forward over the
prompt and the output, paid only by requests that ask.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mtplxd.engine.decoding.sampling import TokenHistory, apply_penalties
from mtplxd.engine.interface import SamplingParams, TokenLogprob
from mtplxd.engine.model.mrope import RowPositions
from mtplxd.engine.model.mrope import attach as attach_positions
from mtplxd.engine.model.trunk import PREFILL_CHUNK, Trunk, run_steps


class LogprobScorer:
    """Scores committed tokens in order; `top` alternatives per token (0 = none)."""

    def __init__(self, trunk: Trunk, params: SamplingParams, prompt_ids: list[int], top: int,
                 vocab_size: int, *, embeddings: mx.array | None = None,
                 positions: RowPositions | None = None) -> None:
        self.trunk, self.params, self.top = trunk, params, top
        self.prompt = list(prompt_ids)
        # A prompt with images: its spliced input embeddings and multimodal positions, so the
        # scored distribution is the one the request sampled from.
        self.embeddings, self.positions = embeddings, positions
        self.history = TokenHistory(vocab_size, prompt_ids)
        self.cache: list[Any] | None = None
        self.next_logits: mx.array | None = None  # (1, V): the row that predicts the next token

    def score(self, tokens: list[int]) -> list[TokenLogprob]:
        """The entries of `tokens`, the next committed tokens of the request."""
        if not tokens:
            return []
        if self.cache is None:
            self._prefill()
        assert self.next_logits is not None
        _, logits = self.trunk.forward(mx.array(tokens)[None], self.cache, all_logits=True)
        rows = mx.concatenate([self.next_logits, logits[0, :-1]], axis=0)
        counts, seen = self.history.rows(mx.array(tokens), len(tokens))
        penalised = apply_penalties(rows, self.params, counts, seen)
        logprobs = penalised - mx.logsumexp(penalised, axis=-1, keepdims=True)
        chosen = mx.take_along_axis(logprobs, mx.array(tokens)[:, None], axis=-1)[:, 0]
        self.history.append(tokens)
        self.next_logits = logits[0, -1:]
        if self.top:
            order = mx.argsort(-logprobs, axis=-1)[:, :self.top]
            best = mx.take_along_axis(logprobs, order, axis=-1)
            mx.eval(chosen, order, best)
            tops = [list(zip(ids, values)) for ids, values in zip(order.tolist(), best.tolist())]
        else:
            mx.eval(chosen)
            tops = [[] for _ in tokens]
        return [TokenLogprob(token, value, top) for token, value, top in zip(tokens, chosen.tolist(), tops)]

    def _prefill(self) -> None:
        self.cache = self.trunk.make_cache()
        attach_positions(self.cache, self.positions)
        _, last_logits = run_steps(self.trunk.prefill_steps(self.prompt, self.cache, PREFILL_CHUNK,
                                                            embeddings=self.embeddings))
        self.next_logits = last_logits.reshape(1, -1)
