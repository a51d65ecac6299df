"""The Gated DeltaNet recurrence over a few tokens at once, without a loop over the tokens.

Why: a verify feeds K+1 tokens through every GDN layer. mlx-lm's `gated_delta_update` runs
one compiled step per token on every backend but Metal (which has its own kernel looping
inside one launch), so on CUDA a hybrid model's verify cost grows with K (a 2B hybrid on the
H200: 14.3 ms decode, 27.4 ms for 2 tokens, 36.9 ms for 4). Here the T tokens are solved
together in a fixed number of ops (the chunked "WY" form of the delta rule), so a verify of
2 or 7 tokens is the same handful of kernels.

The recurrence (per head; state S is Dv x Dk, k unit-norm after `normalize_qk`):
    S_t = g_t S_{t-1} + u_t k_t^T,   u_t = beta_t (v_t - g_t S_{t-1} k_t),   y_t = S_t q_t
With Gamma_t = g_1...g_t and D[t, j] = Gamma_t / Gamma_j (j <= t):
    S_t = Gamma_t S_0 + sum_{j<=t} D[t, j] u_j k_j^T
    (I + N) U = diag(beta) (V - diag(Gamma) K S_0^T),  N[t, j] = beta_t D[t, j] (k_t . k_j), j < t
    Y = diag(Gamma) Q S_0^T + (D o Q K^T) U        (D lower triangular, diagonal included)
N is strictly lower triangular (nilpotent), so (I + N)^-1 = (I - N)(I + N^2)(I + N^4)...,
log2(T) small matrix products instead of a triangular solve (mx.linalg runs on the CPU only).

Rollback needs no replay: the state after the first `keep` tokens is
    S_keep = Gamma_keep S_0 + sum_{j<keep} (Gamma_keep / Gamma_j) u_j k_j^T,
and u_j does not depend on later tokens, so `state_after` rebuilds it from the captured U.
Everything runs in float32, as the recurrence's state does; results equal the per-token
recurrence to float rounding (not bitwise: the sums run in another order). Float32 means
float32 only with MLX's TF32 off, which the engine sees to (mtplxd.matmul_precision): with it
on, CUDA runs these products with 10-bit mantissas.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def log_decay(A_log: mx.array, a: mx.array, dt_bias: mx.array) -> mx.array:
    """log g per token and value head, (B, T, Hv) float32: mlx-lm's `compute_g` before its exp."""
    return -mx.exp(A_log.astype(mx.float32)) * nn.softplus(a + dt_bias).astype(mx.float32)


def chunked_delta(q: mx.array, k: mx.array, v: mx.array, log_g: mx.array, beta: mx.array,
                  state: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """The delta rule over T tokens in one go.

    q, k (B, T, Hk, Dk); v (B, T, Hv, Dv); log_g, beta (B, T, Hv); state (B, Hv, Dv, Dk).
    Returns (y (B, T, Hv, Dv) in q's dtype, the state after all T tokens (float32), U (B, Hv,
    T, Dv) and log Gamma (B, Hv, T): what `state_after` needs to commit a prefix).
    """
    T, Hv = k.shape[1], v.shape[2]
    q32, k32, v32 = (heads_first(x, Hv) for x in (q, k, v))
    beta = beta.astype(mx.float32).transpose(0, 2, 1)[..., None]  # (B, Hv, T, 1)
    log_gamma = mx.cumsum(log_g.transpose(0, 2, 1), axis=-1)  # (B, Hv, T)
    gamma = mx.exp(log_gamma)[..., None]
    decay, n = _decays_and_n(log_gamma, beta, k32, T)
    s0 = state.astype(mx.float32)
    rhs = beta * (v32 - gamma * (k32 @ s0.swapaxes(-1, -2)))
    u = _unit_lower_inverse_apply(n, rhs, T)
    y = gamma * (q32 @ s0.swapaxes(-1, -2)) + (decay * (q32 @ k32.swapaxes(-1, -2))) @ u
    final = state_after(s0, u, k32, log_gamma, T)
    return y.transpose(0, 2, 1, 3).astype(q.dtype), final, u, log_gamma


def _decays_and_n(log_gamma: mx.array, beta: mx.array, k32: mx.array, T: int) -> tuple[mx.array, mx.array]:
    """One solve's D (D[t, j] = Gamma_t / Gamma_j on and below the diagonal, 0 above; exp of
    a difference, never 0/0) and N = diag(beta) (D off its diagonal) o K K^T, over the last
    two axes (T x T) whatever the leading ones."""
    lower = mx.tril(mx.ones((T, T), mx.bool_))
    decay = mx.where(lower, mx.exp(mx.where(lower, log_gamma[..., :, None] - log_gamma[..., None, :], 0.0)), 0.0)
    return decay, beta * (decay * (1 - mx.eye(T))) * (k32 @ k32.swapaxes(-1, -2))


def _unit_lower_inverse_apply(n: mx.array, rhs: mx.array, T: int) -> mx.array:
    """(I + n)^-1 rhs for strictly lower triangular n (T x T): n^T = 0, so the inverse is the
    product (I - n)(I + n^2)(I + n^4)... up to a power >= T."""
    out = rhs - n @ rhs
    power, reach = n @ n, 2
    while reach < T:
        out = out + power @ out
        reach *= 2
        if reach < T:
            power = power @ power
    return out


def state_after(s0: mx.array, u: mx.array, k32: mx.array, log_gamma: mx.array, keep: int) -> mx.array:
    """The state after the first `keep` (>= 1) tokens of a chunk, float32 (B, Hv, Dv, Dk).

    s0 the state before the chunk; u, log_gamma from `chunked_delta`; k32 the chunk's keys as
    `heads_first` gives them.
    """
    lg = log_gamma[..., :keep]
    weight = mx.exp(lg[..., -1:] - lg)[..., None]  # Gamma_keep / Gamma_j
    return mx.exp(lg[..., -1])[..., None, None] * s0 + (weight * u[..., :keep, :]).swapaxes(-1, -2) @ k32[..., :keep, :]


# Tokens `chunked_prefill` solves at once. The series in `_unit_lower_inverse_apply` sums
# powers of N up to T-1, whose entries can grow with T before they cancel, so long runs go
# through in chunks of this size, each the form a verify (and a prompt's last, short prefill
# chunk, up to rollback.DEFAULT_MAX_CAPTURE_TOKENS rows) already takes.
PREFILL_CHUNK_TOKENS = 32


def chunked_prefill(q: mx.array, k: mx.array, v: mx.array, log_g: mx.array, beta: mx.array,
                    state: mx.array, chunk: int = PREFILL_CHUNK_TOKENS) -> tuple[mx.array, mx.array]:
    """The delta rule over a long run of tokens (a prompt), `chunk` tokens a solve. Shapes as
    `chunked_delta`; returns (y, the state after all T tokens).

    A chunk's solve does not depend on the state it starts from: with W_v = (I + N)^-1 diag(beta) V
    and W_k = (I + N)^-1 diag(beta Gamma) K, its U is W_v - W_k S0^T. So every chunk's W_v,
    W_k and decays are computed at once, a loop carries the state from chunk to chunk (one
    product for U and one for the next state), and every chunk's output is computed at once
    from the states it started at: a 512-token prompt chunk is a few dozen ops per layer
    instead of `chunked_delta`'s few dozen per 32 tokens, and the host builds and encodes
    each one (a hybrid's prefill on CUDA is host-bound). A last partial chunk is padded with
    tokens that change nothing (beta 0, decay 1).
    """
    B, T, _, _ = k.shape
    Hv = v.shape[2]
    chunks = -(-T // chunk)
    if (pad := chunks * chunk - T):
        q, k, v = (mx.pad(x, [(0, 0), (0, pad), (0, 0), (0, 0)]) for x in (q, k, v))
        log_g, beta = (mx.pad(x, [(0, 0), (0, pad), (0, 0)]) for x in (log_g, beta))

    def by_chunk(x: mx.array) -> mx.array:  # (B, Hv, chunks * chunk, ...) -> (B, Hv, chunks, chunk, ...)
        return x.reshape(B, Hv, chunks, chunk, *x.shape[3:])

    q32, k32, v32 = (by_chunk(heads_first(x, Hv)) for x in (q, k, v))
    beta = by_chunk(beta.astype(mx.float32).transpose(0, 2, 1))[..., None]
    log_gamma = mx.cumsum(by_chunk(log_g.transpose(0, 2, 1)), axis=-1)  # within each chunk
    decay, n = _decays_and_n(log_gamma, beta, k32, chunk)
    w_v = _unit_lower_inverse_apply(n, beta * v32, chunk)
    w_k = _unit_lower_inverse_apply(n, beta * mx.exp(log_gamma)[..., None] * k32, chunk)
    chunk_decay = mx.exp(log_gamma[..., -1:])[..., None]  # Gamma over each whole chunk
    # The state's update K^T diag(Gamma_chunk / Gamma_j) U, with the keys' side precomputed.
    weighted_keys_t = (mx.exp(log_gamma[..., -1:] - log_gamma)[..., None] * k32).swapaxes(-1, -2)
    # The loop: the state transposed (Dk x Dv), each chunk's pieces split off once, so a
    # chunk costs two products, a difference and a decayed sum.
    s_t = state.astype(mx.float32).swapaxes(-1, -2)[:, :, None]
    pieces = zip(*(mx.split(x, chunks, axis=2) for x in (w_v, w_k, weighted_keys_t, chunk_decay)))
    starts, us = [], []
    for w_v_c, w_k_c, keys_t_c, decay_c in pieces:
        u = w_v_c - w_k_c @ s_t
        starts.append(s_t)
        us.append(u)
        s_t = decay_c * s_t + keys_t_c @ u
    s0_t, u = mx.concatenate(starts, axis=2), mx.concatenate(us, axis=2)
    y = mx.exp(log_gamma)[..., None] * (q32 @ s0_t) + (decay * (q32 @ k32.swapaxes(-1, -2))) @ u
    y = y.reshape(B, Hv, chunks * chunk, -1)[:, :, :T].transpose(0, 2, 1, 3)
    return y.astype(q.dtype), s_t[:, :, 0].swapaxes(-1, -2)


def heads_first(x: mx.array, value_heads: int) -> mx.array:
    """(B, T, H, D) as (B, Hv, T, D) float32, key heads repeated to the value heads (GQA)."""
    if (repeat := value_heads // x.shape[2]) > 1:
        x = mx.repeat(x, repeat, -2)
    return x.astype(mx.float32).transpose(0, 2, 1, 3)


# --- where it runs -----------------------------------------------------------------------

_forced: bool | None = None


def active() -> bool:
    """True where verifies run `chunked_delta` and prompts `chunked_prefill`: on CUDA, where
    mlx-lm loops over the tokens.

    Elsewhere the recurrence stays mlx-lm's: on Metal its kernel loops inside one launch, and
    on the CPU backend a verify row must stay bitwise equal to an AR step (the exactness
    tests). `force(True)` turns the chunked form on anywhere (tests, benches).
    """
    if _forced is not None:
        return _forced
    from mtplxd.engine.model.kv_cache import fixed_shapes_wanted

    return fixed_shapes_wanted()


def force(value: bool | None) -> None:
    """Override `active()` (None: back to the backend's choice)."""
    global _forced
    _forced = value


def path_name() -> str:
    """What /health and status say about the GDN verify: "chunked" or "per-token"."""
    return "chunked" if active() else "per-token"
