"""Rollback of Gated DeltaNet (GDN) state for speculative decoding.

mlx-lm keeps each GDN layer's state in an ``ArraysCache`` (``[conv_state, ssm_state]``),
which has no ``trim``: a rejected draft would stay folded into the recurrent state.
``RollbackArraysCache`` is one more small mlx-lm-style cache with a working ``trim(n)``.

Method (engine.md 1.6, "R1 snapshot + GDN-only replay"):

- Snapshot: before every forward the capturing GDN layer keeps references to the cache's
  conv and recurrent state. This is free: MLX arrays are immutable and the layer rebinds
  ``cache[i]`` instead of writing into it.
- Capture: during a forward of at most ``max_capture_tokens`` tokens the layer also keeps
  references to what the recurrence consumed: the conv input ``[conv_state, qkv]`` and
  the post-conv, normalised ``q, k, v`` plus the raw gates ``a, b`` of every row.
- ``trim(n)``: commit only the first ``T - n`` rows of that forward. The conv state is the
  window ``conv_input[:, keep : keep + K - 1]``; the recurrent state is
  ``gated_delta_update`` replayed over the kept rows from the snapshot. Nothing else of
  the trunk runs again. The replay uses the same function on the same inputs as the
  forward did, so the committed state is the one the forward held after row ``keep - 1``
  (bitwise on the CPU backend, tested).

R0 (restore the snapshot and re-run the trunk over the kept tokens) stays available as
``rollback_by_reforward``: the test oracle, and the reference for what "exact" means.

Capture is installed on a model's GDN modules by ``enable_gdn_capture(model)``: their
class is swapped for a subclass whose ``__call__`` records the captures when its cache is
a ``RollbackArraysCache`` and otherwise defers to mlx-lm's own forward unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_5, qwen3_next
from mlx_lm.models.cache import ArraysCache, KVCache
from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk

from mtplxd.engine.model import gdn_chunked, gdn_kernel

# A verify forward is K+1 tokens (K <= 16 in practice). Longer forwards (prefill) keep only
# the snapshot: capturing them would hold ~2x conv_dim values per token per layer alive.
DEFAULT_MAX_CAPTURE_TOKENS = 32


@dataclass
class GDNCapture:
    """What one forward of a GDN layer consumed, enough to replay a prefix of it."""

    tokens: int  # rows in that forward (T)
    conv_snapshot: mx.array | None  # cache[0] before the forward (None: empty cache)
    state_snapshot: mx.array | None  # cache[1] before the forward
    conv_input: mx.array | None  # [conv_state, qkv] (B, K-1+T, conv_dim); None: not captured
    q: mx.array | None = None
    k: mx.array | None = None
    v: mx.array | None = None
    a: mx.array | None = None
    b: mx.array | None = None
    A_log: mx.array | None = None
    dt_bias: mx.array | None = None
    use_kernel: bool = True
    # Set when the forward ran the chunked delta rule (gdn_chunked.py): a prefix's state is
    # then rebuilt from these without replaying the recurrence.
    u: mx.array | None = None
    log_gamma: mx.array | None = None
    # Set when the forward kept every row's state (gdn_kernel.verify_rows, B x T x Hv x Dv x
    # Dk): a prefix's state is then one of them.
    row_states: mx.array | None = None

    @property
    def replayable(self) -> bool:
        return self.conv_input is not None


class RollbackArraysCache(ArraysCache):
    """``ArraysCache`` of one GDN layer whose ``trim(n)`` drops the last n rows of the last forward.

    Contract:
    - ``is_trimmable()`` is always True (mlx-lm checks it once, before any forward).
    - ``trim(n)`` with ``0 < n <= T`` (T = rows of the last forward through this cache)
      leaves exactly the state a forward of only the first ``T - n`` rows would have left,
      returns n, and clears the capture. ``trim(0)`` only clears the capture and returns 0.
    - ``trim(n)`` raises ``ValueError`` when n > T, when there is no live capture (nothing
      forwarded since the last trim), or when the last forward was not captured (longer
      than ``max_capture_tokens``, or masked/padded); use R0 then.
    - ``restore()`` puts back the state from before the last forward (R0's first half).
    """

    def __init__(
        self,
        size: int = 2,
        left_padding: list[int] | None = None,
        *,
        max_capture_tokens: int = DEFAULT_MAX_CAPTURE_TOKENS,
    ) -> None:
        super().__init__(size, left_padding)
        self.max_capture_tokens = max_capture_tokens
        self.capture: GDNCapture | None = None

    def is_trimmable(self) -> bool:
        return True

    def record(self, capture: GDNCapture) -> None:
        """Called by the capturing GDN layer after each forward through this cache."""
        self.capture = capture

    def trim(self, n: int) -> int:
        """Commit all but the last ``n`` rows of the last forward (see the class contract)."""
        if n < 0:
            raise ValueError(f"cannot trim a negative number of tokens ({n})")
        capture = self.capture
        if n == 0:
            self.capture = None
            return 0
        if capture is None:
            raise ValueError(
                f"cannot trim {n} tokens from a GDN cache: no forward since the last trim "
                "(a GDN cache can only drop rows of its last forward)"
            )
        if n > capture.tokens:
            raise ValueError(
                f"cannot trim {n} tokens from a GDN cache whose last forward had only "
                f"{capture.tokens}"
            )
        if n == capture.tokens:
            self.restore()
            return n
        if not capture.replayable:
            raise ValueError(
                f"cannot trim {n} tokens: the last GDN forward ({capture.tokens} tokens) was "
                "not captured (longer than max_capture_tokens, or masked); restore() "
                "and re-forward instead"
            )
        self._commit_prefix(capture, capture.tokens - n)
        self.capture = None
        return n

    def restore(self) -> None:
        """Put back the conv and recurrent state from before the last forward; clear the capture."""
        if self.capture is None:
            raise ValueError("no forward to undo: the GDN cache holds no snapshot")
        self.cache[0] = self.capture.conv_snapshot
        self.cache[1] = self.capture.state_snapshot
        self.capture = None

    def _commit_prefix(self, c: GDNCapture, keep: int) -> None:
        n_window = c.conv_input.shape[1] - c.tokens
        self.cache[0] = mx.contiguous(c.conv_input[:, keep : keep + n_window, :])
        if c.row_states is not None:
            self.cache[1] = gdn_kernel.state_after_row(c.row_states, keep)
            return
        if c.u is not None:
            self.cache[1] = gdn_chunked.state_after(
                state_or_zeros(c.state_snapshot, (*c.u.shape[:2], c.u.shape[-1], c.k.shape[-1])), c.u,
                gdn_chunked.heads_first(c.k, c.u.shape[1]), c.log_gamma, keep)
            return
        _, state = gated_delta_update(
            c.q[:, :keep],
            c.k[:, :keep],
            c.v[:, :keep],
            c.a[:, :keep],
            c.b[:, :keep],
            c.A_log,
            c.dt_bias,
            c.state_snapshot,
            None,
            use_kernel=c.use_kernel,
        )
        self.cache[1] = state

    # Batch surgery makes a capture meaningless: drop it (a later trim then raises).
    def filter(self, batch_indices: Any) -> None:
        super().filter(batch_indices)
        self.capture = None

    def extend(self, other: ArraysCache) -> None:
        super().extend(other)
        self.capture = None

    def extract(self, idx: int) -> "RollbackArraysCache":
        cache = RollbackArraysCache(len(self.cache), max_capture_tokens=self.max_capture_tokens)
        cache.cache = [c[idx : idx + 1] if c is not None else None for c in self.cache]
        return cache


class _CapturingGDN:
    """Mixin over an mlx-lm GDN module: records a ``GDNCapture`` into a ``RollbackArraysCache``.

    The armed path repeats mlx-lm's forward op for op (projections are family-specific,
    see ``_project``); everything else goes to mlx-lm's own ``__call__``.
    """

    def __call__(self, inputs: mx.array, mask: mx.array | None = None, cache: Any = None):
        if not isinstance(cache, RollbackArraysCache):
            return super().__call__(inputs, mask, cache)
        T = inputs.shape[1]
        plain = mask is None and cache.lengths is None
        if plain and T <= cache.max_capture_tokens:
            return self._captured_forward(inputs, cache)
        conv_snapshot, state_snapshot = cache[0], cache[1]
        if plain and gdn_chunked.active():  # a prompt on CUDA: chunks, not a loop over its tokens
            out = self._captured_forward(inputs, cache, capture=False)
        else:
            out = super().__call__(inputs, mask, cache)
        cache.record(GDNCapture(T, conv_snapshot, state_snapshot, None))
        return out

    def _project(self, inputs: mx.array):
        """Return (qkv (B,T,conv_dim), z (B,T,Hv,Dv), b (B,T,Hv), a (B,T,Hv))."""
        raise NotImplementedError

    def _captured_forward(self, inputs: mx.array, cache: RollbackArraysCache,
                          capture: bool = True) -> mx.array:
        """mlx-lm's forward, recording a replayable GDNCapture; `capture` False records
        nothing (the caller keeps the snapshot) and runs a long T as `chunked_prefill`."""
        B, T, _ = inputs.shape
        qkv, z, b, a = self._project(inputs)
        conv_snapshot, state_snapshot = cache[0], cache[1]
        if conv_snapshot is not None:
            conv_state = conv_snapshot
        else:
            conv_state = mx.zeros(
                (B, self.conv_kernel_size - 1, self.conv_dim), dtype=inputs.dtype
            )
        conv_input = mx.concatenate([conv_state, qkv], axis=1)
        cache[0] = mx.contiguous(conv_input[:, -(self.conv_kernel_size - 1) :, :])
        conv_out = nn.silu(self.conv1d(conv_input))
        q, k, v = [
            t.reshape(B, T, h, d)
            for t, h, d in zip(
                mx.split(conv_out, [self.key_dim, 2 * self.key_dim], -1),
                [self.num_k_heads, self.num_k_heads, self.num_v_heads],
                [self.head_k_dim, self.head_k_dim, self.head_v_dim],
            )
        ]
        q, k = normalize_qk(q, k, inv_scale=self.head_k_dim**-0.5, eps=1e-6)
        use_kernel = not self.training
        u = log_gamma = None
        state0 = state_or_zeros(state_snapshot, (B, self.num_v_heads, self.head_v_dim, self.head_k_dim))
        row_states = None
        if T > 1 and capture and gdn_kernel.verify_rows_wanted(q, k, v, state0):
            # A verify on CUDA: one kernel, each row a decode step's arithmetic, every row's
            # state kept for the rollback (gdn_kernel.verify_rows)
            out, row_states = gdn_kernel.verify_rows(q, k, v, a, b, self.A_log, self.dt_bias, state0)
            state = gdn_kernel.state_after_row(row_states, T)
        elif T > 1 and gdn_chunked.active():  # a verify in one go, a prompt 32 rows a go: no per-row loop
            delta_rule = gdn_chunked.chunked_delta if capture else gdn_chunked.chunked_prefill
            out, state, *wy = delta_rule(
                q, k, v, gdn_chunked.log_decay(self.A_log, a, self.dt_bias), mx.sigmoid(b), state0)
            u, log_gamma = wy or (None, None)  # chunked_prefill keeps no WY factors: no capture
        else:
            # A decode step on CUDA: one kernel instead of mlx-lm's ops (gdn_kernel.py)
            out, state = gdn_kernel.decode_step(
                q, k, v, a, b, self.A_log, self.dt_bias, state0, use_kernel=use_kernel
            )
        cache[1] = state
        cache.advance(T)
        if capture:
            cache.record(
                GDNCapture(
                    T, conv_snapshot, state_snapshot, conv_input,
                    q, k, v, a, b, self.A_log, self.dt_bias, use_kernel, u, log_gamma, row_states,
                )
            )
        out = self.out_proj(self.norm(out, z).reshape(B, T, -1))
        # Split by heads (tensor parallel, mlx-lm's shard()): this rank's captures hold its own
        # heads' conv and recurrent state, which a trim replays locally; only the output is
        # summed across the ranks, as mlx-lm's forward does.
        group = getattr(self, "sharding_group", None)
        return out if group is None else mx.distributed.all_sum(out, group=group)


def state_or_zeros(state: mx.array | None, shape: tuple[int, ...]) -> mx.array:
    """The recurrent state, or the float32 zeros mlx-lm starts from: (B, Hv, Dv, Dk)."""
    return state if state is not None else mx.zeros(shape, dtype=mx.float32)


class RollbackGatedDeltaNet(_CapturingGDN, qwen3_5.GatedDeltaNet):
    """qwen3_5 / qwen3_5_moe GDN: separate in_proj_qkv / z / b / a."""

    def _project(self, inputs):
        B, T, _ = inputs.shape
        qkv = self.in_proj_qkv(inputs)
        z = self.in_proj_z(inputs).reshape(B, T, self.num_v_heads, self.head_v_dim)
        return qkv, z, self.in_proj_b(inputs), self.in_proj_a(inputs)


class RollbackQwen3NextGatedDeltaNet(_CapturingGDN, qwen3_next.Qwen3NextGatedDeltaNet):
    """qwen3_next GDN: fused in_proj_qkvz / in_proj_ba, head-interleaved."""

    def _project(self, inputs):
        B, T, _ = inputs.shape
        q, k, v, z, b, a = self.fix_query_key_value_ordering(
            self.in_proj_qkvz(inputs), self.in_proj_ba(inputs)
        )
        qkv = mx.concatenate(
            [q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], axis=-1
        )
        return qkv, z, b, a


_CAPTURING_CLASS = {
    qwen3_5.GatedDeltaNet: RollbackGatedDeltaNet,
    qwen3_next.Qwen3NextGatedDeltaNet: RollbackQwen3NextGatedDeltaNet,
}


def gdn_modules(model: nn.Module) -> list[nn.Module]:
    """The GDN (linear attention) modules of a hybrid mlx-lm model, in layer order."""
    return [layer.linear_attn for layer in model.layers if getattr(layer, "is_linear", False)]


def enable_gdn_capture(model: nn.Module) -> int:
    """Make every GDN module of ``model`` record captures into ``RollbackArraysCache``s.

    Swaps each module's class for its capturing subclass (parameters, names and the
    forward with any other cache are unchanged). Idempotent; returns how many modules
    were converted now. Raises ``TypeError`` for a GDN class it does not know.
    """
    converted = 0
    for module in gdn_modules(model):
        if isinstance(module, _CapturingGDN):
            continue
        capturing = _CAPTURING_CLASS.get(type(module))
        if capturing is None:
            raise TypeError(f"no rollback support for GDN module {type(module).__name__}")
        module.__class__ = capturing
        converted += 1
    return converted


def make_rollback_cache(model: nn.Module, *, max_capture_tokens: int = DEFAULT_MAX_CAPTURE_TOKENS) -> list:
    """Per-layer caches for a hybrid mlx-lm model: ``RollbackArraysCache`` for GDN layers,
    ``KVCache`` for attention layers. Also enables capture on the model (idempotent)."""
    enable_gdn_capture(model)
    return [
        RollbackArraysCache(2, max_capture_tokens=max_capture_tokens)
        if getattr(layer, "is_linear", False)
        else KVCache()
        for layer in model.layers
    ]


def rollback_by_reforward(
    model: nn.Module, cache: Sequence[Any], tokens: mx.array, keep: int
) -> mx.array:
    """R0 oracle: undo the last forward of ``tokens`` (B, T) on every cache, re-run the first ``keep``.

    GDN caches are restored from their snapshot, attention caches trimmed by T, then the
    whole model runs over ``tokens[:, :keep]``. Returns that forward's logits (or None
    when keep == 0). Costs one extra trunk forward; exact by construction.
    """
    T = tokens.shape[1]
    for c in cache:
        if isinstance(c, RollbackArraysCache):
            c.restore()
        else:
            c.trim(T)
    if keep == 0:
        return None
    return model(tokens[:, :keep], cache=list(cache))


def gdn_state_arrays(cache: Iterable[Any]) -> list[tuple[mx.array, mx.array]]:
    """(conv_state, recurrent_state) of every GDN cache, in layer order (for tests/inspection)."""
    return [(c[0], c[1]) for c in cache if isinstance(c, ArraysCache)]
