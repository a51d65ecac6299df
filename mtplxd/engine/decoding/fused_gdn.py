"""Gated DeltaNet (GDN) layers inside the fused cycle (fused.py): rollback with the accepted
count still on the device.

The stepwise loop rolls a GDN layer back on the host: it reads the cycle's accepted count,
then `RollbackArraysCache.trim` rebuilds the state after the kept rows (rollback.py). The
fused cycle never reads the count back, so here the same rebuild takes the number of kept
rows as a device scalar and every shape stays fixed:

- conv state: the kernel-1 rows of the forward's conv input that follow the kept rows, a
  gather at `keep + arange(window)` instead of a slice;
- recurrent state, verify on the every-row kernel (CUDA, gdn_kernel.verify_rows): the
  state after `keep` rows, gathered from the states it kept;
- recurrent state, chunked verify (CUDA without that kernel, gdn_chunked.active()):
  `state_after` with the rows past `keep` weighted 0 instead of sliced off;
- recurrent state, per-token verify (CPU, Metal): the forward's recurrence stepped one row
  at a time from the snapshot, the state after `keep` rows picked as the steps go. Each
  step is `gated_delta_update` over one row, the op the stepwise loop's replay and an AR step
  run, so greedy MTP stays bitwise equal to AR on the CPU backend.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.gated_delta import gated_delta_update

from mtplxd.engine.model import gdn_chunked, gdn_kernel
from mtplxd.engine.model.rollback import GDNCapture, RollbackArraysCache, state_or_zeros


class FusedGDNCache(RollbackArraysCache):
    """One GDN layer's conv and recurrent state for one fused cycle's verify forward. The
    capturing GDN forward (rollback._CapturingGDN) records what it consumed, as it does for
    the stepwise loop's cache; `committed(keep)` then gives the state after the first `keep`
    rows of that forward, lazily, for the next cycle."""

    def __init__(self, conv: mx.array, state: mx.array) -> None:
        super().__init__(2)
        self.cache[0], self.cache[1] = conv, state

    def committed(self, keep: mx.array) -> tuple[mx.array, mx.array]:
        """(conv state, recurrent state) after the first `keep` (int32 scalar, >= 1) rows of
        the last forward."""
        capture = self.capture
        if capture is None or not capture.replayable:
            raise ValueError("no captured GDN forward to commit (a verify block is at most "
                             f"{self.max_capture_tokens} rows)")
        return conv_window_at(capture, keep), recurrent_state_at(capture, keep)


def conv_window_at(capture: GDNCapture, keep: mx.array) -> mx.array:
    """The conv state after `keep` rows: conv_input[:, keep : keep + window]."""
    window = capture.conv_input.shape[1] - capture.tokens
    return mx.take(capture.conv_input, keep + mx.arange(window), axis=1)


def recurrent_state_at(capture: GDNCapture, keep: mx.array) -> mx.array:
    """The recurrent state after `keep` rows of the captured forward, float32 (B, Hv, Dv, Dk)."""
    if capture.row_states is not None:  # the verify kept every row's state: pick one
        return gdn_kernel.state_after_row(capture.row_states, keep)
    if capture.u is not None:
        u = capture.u
        s0 = state_or_zeros(capture.state_snapshot, (*u.shape[:2], u.shape[-1], capture.k.shape[-1]))
        return chunked_state_at(s0, u, gdn_chunked.heads_first(capture.k, u.shape[1]),
                                capture.log_gamma, keep)
    # Each row's state is picked as it is made, not all stacked: a row's state (3 MB a layer
    # at 27B size) is freed once the next step and the pick have read it, whatever the depth.
    state, picked = capture.state_snapshot, None
    for t in range(capture.tokens):
        _, state = gated_delta_update(
            capture.q[:, t:t + 1], capture.k[:, t:t + 1], capture.v[:, t:t + 1],
            capture.a[:, t:t + 1], capture.b[:, t:t + 1], capture.A_log, capture.dt_bias,
            state, None, use_kernel=capture.use_kernel)
        picked = state if picked is None else mx.where(keep == t + 1, state, picked)
    return picked


def chunked_state_at(s0: mx.array, u: mx.array, k32: mx.array, log_gamma: mx.array,
                     keep: mx.array) -> mx.array:
    """gdn_chunked.state_after with `keep` a device scalar: the rows from `keep` on get weight
    0 (S_keep = Gamma_keep S_0 + sum_{j<keep} (Gamma_keep / Gamma_j) u_j k_j^T)."""
    T = log_gamma.shape[-1]
    lg_keep = mx.take(log_gamma, (keep - 1).reshape(1), axis=-1)  # (B, Hv, 1)
    kept = mx.arange(T) < keep
    # exp of a difference that is <= 0 for kept rows; the others are zeroed before the exp.
    weight = mx.where(kept, mx.exp(mx.where(kept, lg_keep - log_gamma, 0.0)), 0.0)[..., None]
    return mx.exp(lg_keep)[..., None] * s0 + (weight * u).swapaxes(-1, -2) @ k32
