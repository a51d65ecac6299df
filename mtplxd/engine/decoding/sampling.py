"""Turning logits into a distribution, and picking tokens from it with explicit keys.

One definition serves the AR path, the MTP drafts (q) and the verify rows (p):
  1. penalties on the raw logits (float32), from the token history of that exact position:
     repetition (HF rule: divide positive logits, multiply negative ones) over prompt and
     output tokens; presence and frequency (OpenAI rule: subtract) over output tokens only;
  2. log-softmax, then the filters on the untempered log-probabilities in mlx-lm's order:
     top-p, min-p, top-k (filtered entries become -inf);
  3. divide by the temperature. p = softmax of the result.
Temperature 0 is argmax of the penalised logits (first index on ties, as `mx.argmax`).

Random draws never touch MLX's global random state: every draw takes a key derived from
(seed, absolute position, purpose), so a seeded request gives the same output whatever the
cycle boundaries are.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Callable

import mlx.core as mx

from mtplxd.engine.decoding.compiled import per_thread
from mtplxd.engine.interface import SamplingParams

# Purposes of a random draw; each gets its own key stream. CYCLE: all of a fused cycle's
# random numbers, drawn at once (fused._cycle_noise).
DRAFT, ACCEPT, RESIDUAL, TARGET, CYCLE = 1, 2, 3, 4, 5
_NEG_INF = float("-inf")


def position_key(seed: int, position: int, purpose: int) -> mx.array:
    """A PRNG key that depends only on (seed, absolute position, purpose)."""
    mixed = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + purpose * 0x94D049BB133111EB)
    return mx.random.key(mixed % (1 << 63))


def _mix32_int(x: int) -> int:
    """lowbias32 (C. Wellons) on a Python int: the host twin of `_mix32`."""
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def seed_words(seed: int) -> mx.array:
    """The seed as two uint32 words for keys derived on the device, each word already mixed
    from all 64 bits (once per request, on the host), so the device needs no cross-word mixing
    and no indexing into the seed (`device_position_keys`)."""
    seed %= 1 << 64
    low, high = seed & 0xFFFFFFFF, seed >> 32
    return mx.array([_mix32_int(low ^ _mix32_int(high + 0x9E3779B9)),
                     _mix32_int(high ^ _mix32_int(low + 0x7F4A7C15))], mx.uint32)


def _mix32(x: mx.array) -> mx.array:
    """lowbias32 (C. Wellons): a well-mixed bijection of uint32."""
    x = x ^ (x >> 16)
    x = x * mx.array(0x7FEB352D, mx.uint32)
    x = x ^ (x >> 15)
    x = x * mx.array(0x846CA68B, mx.uint32)
    return x ^ (x >> 16)


_KEY_WORD_SALT = (0x9E3779B9, 0x85EBCA6B)  # one per word of a key: the two words differ


def device_position_keys(seed: mx.array, positions: mx.array, purpose: int) -> mx.array:
    """(len(positions), 2) PRNG keys from (seed words, absolute positions, purpose), computed
    on the device, so a position that is still a lazy array (the fused loop) gets its key
    without a host sync. Distinct positions and purposes give distinct keys (a bijection of
    the counter per word), and the draw's Threefry makes distinct keys unrelated streams.

    Why this shape: word j of a key is mix((position ^ seed[j]) * 8 + salt[j] + purpose),
    one elementwise expression over a (N, 2) broadcast, with no indexing and no stack, so
    inside a compiled graph it is one fused kernel per token (a launch, not six, on a GPU).
    """
    # Every op has the key's (N, 2) shape (the first one broadcasts) and the purpose is in the
    # salt (a constant): few enough same-shaped ops for MLX to fuse them into one kernel.
    # Distinct: (position ^ seed[j]) * 8 has its low 3 bits clear, so purposes 0..7 cannot collide.
    counter = (positions.astype(mx.uint32)[:, None] ^ seed) * 8
    return _mix32(counter + mx.array([s + purpose for s in _KEY_WORD_SALT], mx.uint32))


def one_hot(tokens: mx.array, vocab_size: int) -> mx.array:
    """(len(tokens), vocab_size) float32 rows, 1 at each token id (penalty counts)."""
    return (tokens[:, None] == mx.arange(vocab_size)[None]).astype(mx.float32)


def history_rows(counts: mx.array, seen: mx.array, extra: mx.array | None,
                 n_rows: int) -> tuple[mx.array, mx.array]:
    """(counts, seen) of (V,) histories for n_rows positions: row i also holds extra[:i]
    (the drafts before it)."""
    vocab_size = counts.shape[-1]
    counts = mx.broadcast_to(counts, (n_rows, vocab_size))
    seen = mx.broadcast_to(seen, (n_rows, vocab_size))
    if extra is not None and n_rows > 1:
        cum = mx.concatenate([mx.zeros((1, vocab_size)),
                              mx.cumsum(one_hot(extra[:n_rows - 1], vocab_size), axis=0)], axis=0)
        counts = counts + cum
        seen = seen + cum
    return counts, seen


class TokenHistory:
    """Per-request token counts that the penalties read (kept on the device).

    `seen` marks prompt and output tokens (repetition penalty); `counts` counts output tokens
    (presence and frequency penalties).
    """

    def __init__(self, vocab_size: int, prompt_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self.counts = mx.zeros((vocab_size,), dtype=mx.float32)
        seen = mx.zeros((vocab_size,), dtype=mx.float32)
        if prompt_ids:
            seen = seen.at[mx.array(prompt_ids)].add(1.0)
        self.seen = seen

    def append(self, token_ids: list[int] | mx.array) -> None:
        """Record committed output tokens (a list, or a lazy array of token ids)."""
        if isinstance(token_ids, list) and not token_ids:
            return
        idx = token_ids if isinstance(token_ids, mx.array) else mx.array(token_ids)
        self.counts = self.counts.at[idx].add(1.0)
        self.seen = self.seen.at[idx].add(1.0)

    def rows(self, extra: mx.array | None, n_rows: int) -> tuple[mx.array, mx.array]:
        """(counts, seen) for n_rows positions: row i also holds extra[:i] (drafts so far)."""
        return history_rows(self.counts, self.seen, extra, n_rows)


def apply_penalties(logits: mx.array, params: SamplingParams, counts: mx.array,
                    seen: mx.array) -> mx.array:
    """Penalised float32 logits (rows x V); a no-op without penalties."""
    logits = logits.astype(mx.float32)
    if not params.has_penalties:
        return logits
    if params.repetition_penalty != 1.0:
        rp = params.repetition_penalty
        penalised = mx.where(logits > 0, logits / rp, logits * rp)
        logits = mx.where(seen > 0, penalised, logits)
    if params.frequency_penalty != 0.0:
        logits = logits - params.frequency_penalty * counts
    if params.presence_penalty != 0.0:
        logits = logits - params.presence_penalty * (counts > 0).astype(mx.float32)
    return logits


def _top_p(logprobs: mx.array, top_p: float) -> mx.array:
    order = mx.argsort(-logprobs, axis=-1)
    sorted_lp = mx.take_along_axis(logprobs, order, axis=-1)
    probs = mx.exp(sorted_lp)
    before = mx.cumsum(probs, axis=-1) - probs
    keep_sorted = before < top_p
    keep = mx.put_along_axis(mx.zeros_like(keep_sorted), order, keep_sorted, axis=-1)
    return mx.where(keep, logprobs, _NEG_INF)


def _min_p(logprobs: mx.array, min_p: float) -> mx.array:
    threshold = mx.max(logprobs, axis=-1, keepdims=True) + mx.log(mx.array(min_p, mx.float32))
    return mx.where(logprobs >= threshold, logprobs, _NEG_INF)


def _top_k(logprobs: mx.array, top_k: int) -> mx.array:
    if top_k >= logprobs.shape[-1]:
        return logprobs
    kth = mx.sort(logprobs, axis=-1)[..., -top_k][..., None]
    # Ties at the k-th value are all kept: deterministic and identical on every path.
    return mx.where(logprobs >= kth, logprobs, _NEG_INF)


def scaled_logits(penalised: mx.array, params: SamplingParams) -> mx.array:
    """Filtered, tempered log-weights: p = softmax(result). Requires temperature > 0."""
    logprobs = penalised - mx.logsumexp(penalised, axis=-1, keepdims=True)
    if 0.0 < params.top_p < 1.0:
        logprobs = _top_p(logprobs, params.top_p)
    if params.min_p > 0.0:
        logprobs = _min_p(logprobs, params.min_p)
    if params.top_k > 0:
        logprobs = _top_k(logprobs, params.top_k)
    return logprobs / params.temperature


def sorted_scaled_logits(penalised: mx.array, params: SamplingParams) -> tuple[mx.array, mx.array]:
    """`scaled_logits` in descending order of probability: (order, weights) with
    weights[..., j] = scaled_logits(...)[..., order[..., j]]. Requires temperature > 0.

    Why: top-p needs the vocabulary sorted anyway, and in sorted order every filter keeps a
    prefix, so top-p, min-p and top-k become comparisons on the sorted row, with no scatter
    back into vocabulary order and no second sort for top-k. A token drawn from these
    weights is order[index]; its distribution is exactly softmax(scaled_logits(...)): the
    same argsort decides the top-p boundary, min-p's threshold and top-k's k-th value
    (ties at it kept) are the same numbers.
    """
    logprobs = penalised - mx.logsumexp(penalised, axis=-1, keepdims=True)
    order = mx.argsort(-logprobs, axis=-1)
    lp = mx.take_along_axis(logprobs, order, axis=-1)
    keep = mx.ones(lp.shape, dtype=mx.bool_)
    if 0.0 < params.top_p < 1.0:
        probs = mx.exp(lp)
        keep = (mx.cumsum(probs, axis=-1) - probs) < params.top_p
    if params.min_p > 0.0:
        keep = keep & (lp >= lp[..., :1] + mx.log(mx.array(params.min_p, mx.float32)))
    if 0 < params.top_k < lp.shape[-1]:
        filtered = mx.where(keep, lp, _NEG_INF)
        keep = keep & (filtered >= filtered[..., params.top_k - 1:params.top_k])
    return order, mx.where(keep, lp, _NEG_INF) / params.temperature


def draft_weights(penalised: mx.array, params: SamplingParams) -> mx.array:
    """The MTP draft's log-weights, q = softmax(result): the penalised logits with min-p,
    divided by the temperature, but without the filters that need a sort (top-p, top-k).

    Why: speculative sampling is exact for any draft distribution q (the residual
    norm(max(0, p - q)) corrects it), so the draft need not be filtered like the target. A
    sort over the vocabulary per drafted token was most of a sampled draft's cost on a GPU;
    drafting from the wider q costs little acceptance (docs/engine.md, "Sampled drafts").
    Requires temperature > 0.
    """
    if params.min_p > 0.0:  # min-p needs no sort; the threshold is the same on logits
        penalised = _min_p(penalised, params.min_p)
    return penalised / params.temperature


def probabilities(logits: mx.array, params: SamplingParams, counts: mx.array,
                  seen: mx.array) -> mx.array:
    """The exact float32 sampling distribution for each row of raw logits (temperature > 0)."""
    return mx.softmax(scaled_logits(apply_penalties(logits, params, counts, seen), params), axis=-1)


def pick(logits: mx.array, params: SamplingParams, counts: mx.array, seen: mx.array,
         keys: list[mx.array] | None) -> mx.array:
    """One token per row: argmax at temperature 0, else a keyed categorical draw."""
    penalised = apply_penalties(logits, params, counts, seen)
    if params.greedy:
        return mx.argmax(penalised, axis=-1)
    weights = scaled_logits(penalised, params)
    assert keys is not None and len(keys) == weights.shape[0]
    return mx.stack([mx.random.categorical(weights[i], key=keys[i]) for i in range(len(keys))])


def graph_key(params: SamplingParams) -> tuple:
    """The sampling settings a compiled graph bakes in (everything but seed, stops, length)."""
    skip = {"seed", "max_tokens", "stop", "stop_token_ids", "ignore_eos"}
    return tuple(getattr(params, f.name) for f in fields(params) if f.name not in skip)


_ROW_SAMPLERS: dict[tuple, Callable] = {}  # compiled samplers by (thread, graph_key), least recent first
_ROW_SAMPLER_SLOTS = 16


def row_sampler(params: SamplingParams) -> Callable[..., tuple[mx.array, mx.array]]:
    """The AR step's whole sampler chain as one compiled function (built once per setting;
    plain greedy, one argmax, is not compiled):
    sample(logits (1, V), counts (1, V), seen (1, V), seed words, position (1,) uint32)
    -> (token (1,), the next position: position + 1; greedy without penalties, which reads
    neither, hands `position` back untouched).

    Why compiled: uncompiled, penalties, log-softmax, top-p's sort and scatter, min-p, top-k,
    the temperature and the draw are a dozen separate kernels and as many graph nodes the host
    builds every token; mlx-lm compiles its sampler, and on a GPU the difference is tens of
    microseconds a token. The key of the draw is derived from (seed, position, TARGET) on the
    device (`device_position_keys`, one fused kernel), so no key array is made on the host
    either, and the position advances inside the graph. Shapes are fixed, so it traces once.
    Per token it launches no more kernels than mlx-lm's `generate_step` sampler does (greedy:
    one argmax against its log-softmax and argmax; top-p: the same count), as
    `bench.ar_parity` counts them from the graph.
    """
    # Settings vary per request: the cache stays bounded (and per thread: compiled.py).
    return per_thread(_ROW_SAMPLERS, graph_key(params), lambda: _row_sampler(params),
                      slots=_ROW_SAMPLER_SLOTS)


def _row_sampler(params: SamplingParams) -> Callable:
    """The sampler function for `params`, compiled unless it is a plain argmax."""

    def sample(logits: mx.array, counts: mx.array, seen: mx.array, seed: mx.array,
               position: mx.array) -> tuple[mx.array, mx.array]:
        penalised = apply_penalties(logits, params, counts, seen)
        if params.greedy:
            token = mx.argmax(penalised, axis=-1)
        elif 0.0 < params.top_p < 1.0 or params.top_k > 0:  # sorting anyway: draw in sorted order
            order, weights = sorted_scaled_logits(penalised, params)
            draw_key = device_position_keys(seed, position, TARGET).reshape(2)
            index = mx.random.categorical(weights, key=draw_key)
            token = mx.take_along_axis(order, index[:, None], axis=-1)[:, 0]
        else:
            draw_key = device_position_keys(seed, position, TARGET).reshape(2)
            token = mx.random.categorical(scaled_logits(penalised, params), key=draw_key)
        return token.astype(mx.uint32), position + 1

    # Plain greedy is a single op: compiling it would only add a compiled call's host cost.
    plain = params.greedy and not params.has_penalties
    return _plain_argmax if plain else mx.compile(sample)


def _plain_argmax(logits: mx.array, counts: mx.array, seen: mx.array, seed: mx.array,
                  position: mx.array) -> tuple[mx.array, mx.array]:
    """Greedy without penalties: the argmax of the raw logits (a float32 copy, exact and
    order-preserving, would pick the same index); no key is drawn, so the position is handed
    back as it is."""
    return mx.argmax(logits, axis=-1).astype(mx.uint32), position


def pick_first(last_logits: mx.array, params: SamplingParams, history: TokenHistory, seed: int,
               position: int) -> int:
    """The first generated token, picked from the prompt's last-row logits (V,) as the token
    at absolute `position` (the prompt's length), and recorded in `history`."""
    counts, seen = history.rows(None, 1)
    keys = None if params.greedy else [position_key(seed, position, TARGET)]
    first = pick(last_logits[None], params, counts, seen, keys).item()
    history.append([first])
    return first
