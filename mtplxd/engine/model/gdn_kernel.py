"""A Gated DeltaNet (GDN) layer's recurrence for a decode step in one CUDA kernel: the CUDA
twin of mlx-lm's Metal `gated_delta_kernel`.

Why: on CUDA mlx-lm runs the recurrence as ops. Per GDN layer and token that is sigmoid(b),
`compute_g`, a repeat of q and of k for the grouped heads, the step's elementwise kernels
and two sums, and the views between them. The hybrid 27B's AR step is 3,741 primitives on
the H200 (4-bit), and its host time is its wall time (22.8 ms, docs/benchmarks.md, "The
hybrid's fused loop on the H200"): the host building and encoding nodes is what a token
costs. This kernel reads q, k, v, a, b, A_log, dt_bias and the state and writes y and the
new state in one launch: the grouped heads by index, the gate and beta inside.

Arithmetic: that of mlx-lm's ops (`gated_delta_update` off Metal) in float32, with
`a + dt_bias`, its softplus and sigmoid(b) computed by MLX's own CUDA functors at the dtypes
MLX computes them in, so the gate and beta are the ops' to the bit. The two sums over the
key dimension run lane by lane, then across the warp in a butterfly (as the Metal kernel's
simd_sum), so they can round apart from the ops' sums in the last bits.

Where: CUDA decode steps (one token) of the captured GDN forward (rollback._CapturingGDN),
once a probe on this machine compiled the kernel and matched the ops. Verifies and prompts
keep the chunked form (gdn_chunked); the CPU backend and Metal keep mlx-lm's own path, so
the CPU's exactness tests are untouched. `MTPLX_GDN_KERNEL=0` turns it off.
"""

from __future__ import annotations

import os

import mlx.core as mx
from mlx_lm.models.gated_delta import gated_delta_update

from mtplxd.engine.model import custom_kernels

# Grid (x: 32 lanes, y: value rows, z: batch x value heads); a block is 4 warps, each warp
# one value row. Lane l keeps the row's state elements [l*E, l*E+E) of the key dimension
# in registers across the T steps.
_SOURCE = r"""
    constexpr int E = Dk / 32;
    const int lane = threadIdx.x;
    const int dv = blockIdx.y * blockDim.y + threadIdx.y;
    const int n = blockIdx.z;
    const int batch = n / Hv;
    const int hv = n % Hv;
    const int hk = hv / (Hv / Hk);

    const auto* q_ = q + ((size_t)batch * T * Hk + hk) * Dk + lane * E;
    const auto* k_ = k + ((size_t)batch * T * Hk + hk) * Dk + lane * E;
    const auto* v_ = v + ((size_t)batch * T * Hv + hv) * Dv;
    auto* y_ = y + ((size_t)batch * T * Hv + hv) * Dv;
    const auto* a_ = a + (size_t)batch * T * Hv + hv;
    const auto* b_ = b + (size_t)batch * T * Hv + hv;
    const float decay_rate = expf(static_cast<float>(A_log[hv]));
    const GateT bias = static_cast<GateT>(dt_bias[hv]);
    const float* s_in = state_in + ((size_t)n * Dv + dv) * Dk + lane * E;
    /*STATE_OUT*/

    float s[E];
    for (int i = 0; i < E; ++i) s[i] = s_in[i];
    for (int t = 0; t < T; ++t) {
      // g = exp(-exp(A_log) * softplus(a + dt_bias)) and beta = sigmoid(b), through MLX's
      // own functors at the dtypes MLX computes them in (softplus is logaddexp(x, 0)).
      const GateT x = static_cast<GateT>(a_[0]) + bias;
      const float softplus = static_cast<float>(LogAddExp{}(x, static_cast<GateT>(0.0f)));
      const float g = expf(-decay_rate * softplus);
      const float beta = static_cast<float>(Sigmoid{}(b_[0]));
      float kv = 0.0f;
      for (int i = 0; i < E; ++i) {
        s[i] = s[i] * g;
        kv += s[i] * static_cast<float>(k_[i]);
      }
      for (int offset = 16; offset > 0; offset >>= 1) kv += __shfl_xor_sync(0xffffffff, kv, offset);
      const float delta = (static_cast<float>(v_[dv]) - kv) * beta;
      float out = 0.0f;
      for (int i = 0; i < E; ++i) {
        s[i] = s[i] + static_cast<float>(k_[i]) * delta;
        out += s[i] * static_cast<float>(q_[i]);
      }
      for (int offset = 16; offset > 0; offset >>= 1) out += __shfl_xor_sync(0xffffffff, out, offset);
      if (lane == 0) y_[dv] = static_cast<InT>(out);
      /*STORE_ROW*/
      q_ += Hk * Dk;
      k_ += Hk * Dk;
      v_ += Hv * Dv;
      y_ += Hv * Dv;
      a_ += Hv;
      b_ += Hv;
    }
    /*STORE_FINAL*/
"""
# The decode step keeps only the state after its last row; a verify keeps every row's
# (`row_states`: B, T, Hv, Dv, Dk), so a rollback to any accepted count is one gather.
_STORE_FINAL = "for (int i = 0; i < E; ++i) s_out[i] = s[i];"
_STORE_ROW = """{
        float* row_ = row_states + ((((size_t)batch * T + t) * Hv + hv) * Dv + dv) * Dk + lane * E;
        for (int i = 0; i < E; ++i) row_[i] = s[i];
      }"""

# Sigmoid and LogAddExp: the functors MLX's own CUDA ops and compiled kernels apply.
_HEADER = """
#include "mlx/backend/cuda/device/binary_ops.cuh"
#include "mlx/backend/cuda/device/unary_ops.cuh"
"""
_WARPS_PER_BLOCK = 4
_DTYPES = (mx.bfloat16, mx.float16, mx.float32)

_kernels: dict[bool, object] = {}
_usable: bool | None = None
_rows_usable: bool | None = None


def _gdn_kernel(every_row: bool = False):
    """The kernel keeping the final state, or (`every_row`) each row's state."""
    if every_row not in _kernels:
        source = (_SOURCE.replace("/*STORE_ROW*/", _STORE_ROW if every_row else "")
                  .replace("/*STORE_FINAL*/", "" if every_row else _STORE_FINAL)
                  .replace("/*STATE_OUT*/", "" if every_row else
                           "float* s_out = state_out + ((size_t)n * Dv + dv) * Dk + lane * E;"))
        _kernels[every_row] = custom_kernels.cuda_kernel(
            name="mtplx_gated_delta_rows" if every_row else "mtplx_gated_delta_step",
            input_names=["q", "k", "v", "a", "b", "A_log", "dt_bias", "state_in"],
            output_names=["y", "row_states" if every_row else "state_out"], source=source, header=_HEADER)
    return _kernels[every_row]


def _sum_dtype(x: mx.Dtype, y: mx.Dtype) -> mx.Dtype:
    """The dtype MLX gives x + y for the float dtypes here."""
    return x if x == y else mx.float32


def gated_delta_kernel(q: mx.array, k: mx.array, v: mx.array, a: mx.array, b: mx.array,
                       A_log: mx.array, dt_bias: mx.array, state: mx.array, *,
                       every_row: bool = False) -> tuple[mx.array, mx.array]:
    """(y (B, T, Hv, Dv), the state after T steps) from normalized q, k (B, T, Hk, Dk), v
    (B, T, Hv, Dv), the raw gate inputs a, b (B, T, Hv), A_log and dt_bias (Hv,) and the
    float32 state (B, Hv, Dv, Dk); with `every_row` the state after each step instead,
    (B, T, Hv, Dv, Dk). CUDA only: see `usable` and `supported`."""
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    states_shape = (B, T, *state.shape[1:]) if every_row else state.shape
    return _gdn_kernel(every_row)(
        inputs=[q, k, v, a, b, A_log, dt_bias, state],
        template=[("InT", q.dtype), ("GateT", _sum_dtype(a.dtype, dt_bias.dtype)),
                  ("BetaT", b.dtype), ("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv), ("T", T)],
        grid=(32, Dv, B * Hv), threadgroup=(32, _WARPS_PER_BLOCK, 1),
        output_shapes=[(B, T, Hv, Dv), states_shape], output_dtypes=[q.dtype, mx.float32])


def supported(q: mx.array, k: mx.array, v: mx.array, state: mx.array) -> bool:
    """The kernel's domain: a key dimension 32 lanes split evenly, whole warps of value rows,
    whole groups of value heads per key head, a float32 state."""
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    return (Dk % 32 == 0 and Dv % _WARPS_PER_BLOCK == 0 and Hv % Hk == 0
            and q.dtype in _DTYPES and q.dtype == k.dtype == v.dtype
            and state.dtype == mx.float32 and state.shape == (B, Hv, Dv, Dk))


def decode_step(q: mx.array, k: mx.array, v: mx.array, a: mx.array, b: mx.array,
                A_log: mx.array, dt_bias: mx.array, state: mx.array,
                use_kernel: bool = True) -> tuple[mx.array, mx.array]:
    """`gated_delta_update`'s (y, state) for a one-token step from `state` (zeros before the
    first token: rollback.state_or_zeros): this kernel where it is usable and the shapes are
    its own, else mlx-lm's function (its Metal kernel, or ops)."""
    if q.shape[1] == 1 and usable() and supported(q, k, v, state):
        return gated_delta_kernel(q, k, v, a, b, A_log, dt_bias, state)
    return gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, None, use_kernel=use_kernel)


# The longest verify, depth 8 (loader.MAX_DEPTH) plus the committed token. Every row's state
# is kept until the accept decides (3 MB a row and layer at the hybrid 27B's size, 48 layers:
# 576 MB over a depth-3 verify), so a longer captured forward (a short prompt) is not one.
MAX_VERIFY_ROWS = 9


def verify_rows_wanted(q: mx.array, k: mx.array, v: mx.array, state: mx.array) -> bool:
    """Whether a captured forward of up to MAX_VERIFY_ROWS rows (a verify) runs `verify_rows`
    (its rows' states kept for the rollback) instead of the chunked form: on CUDA once the
    every-row kernel passed its probe and the shapes are its own; anywhere when forced
    (`force_verify_rows`, tests)."""
    if q.shape[1] > MAX_VERIFY_ROWS:
        return False
    if _forced_rows is not None:
        return _forced_rows
    return rows_usable() and supported(q, k, v, state)


def verify_rows(q: mx.array, k: mx.array, v: mx.array, a: mx.array, b: mx.array,
                A_log: mx.array, dt_bias: mx.array, state: mx.array) -> tuple[mx.array, mx.array]:
    """(y (B, T, Hv, Dv), the state after each row (B, T, Hv, Dv, Dk)) of a verify forward:
    the every-row kernel where it is usable, else mlx-lm's step once per row (the CPU when
    forced). Each row is the arithmetic of a decode step, so a verify row equals an AR step
    there, and a rollback to any accepted count is a gather."""
    if rows_usable() and supported(q, k, v, state):
        return gated_delta_kernel(q, k, v, a, b, A_log, dt_bias, state, every_row=True)
    ys, states = [], []
    for t in range(q.shape[1]):
        rows = slice(t, t + 1)
        y, state = decode_step(q[:, rows], k[:, rows], v[:, rows], a[:, rows], b[:, rows],
                               A_log, dt_bias, state)
        ys.append(y)
        states.append(state)
    return mx.concatenate(ys, axis=1), mx.stack(states, axis=1)


def state_after_row(row_states: mx.array, count: int | mx.array) -> mx.array:
    """The state after the first `count` rows (an int or a device scalar) of `verify_rows`'
    `row_states`, as its own array: a gather, not a view, so the other rows' states (3 MB a
    row and layer at 27B size) are freed once the rollback is done."""
    return mx.take(row_states, (mx.array(count) - 1).reshape(1), axis=1)[:, 0]


def force_verify_rows(value: bool | None) -> None:
    """Override `verify_rows_wanted` (None: back to its rule); for tests."""
    global _forced_rows
    _forced_rows = value


_forced_rows: bool | None = None


def rows_usable() -> bool:
    """True on CUDA once the every-row kernel compiled and matched mlx-lm's steps on a probe
    of 4 rows (checked once per process), and the decode kernel is usable."""
    global _rows_usable
    if _rows_usable is None:
        _rows_usable = usable() and custom_kernels.probe(
            "gated delta verify", lambda: rows_probe_error(4), 1.0, "the chunked GDN verify")
    return _rows_usable


def rows_probe_error(tokens: int) -> float:
    """The every-row kernel against mlx-lm's step once per row on `probe_inputs`: the largest
    y error and row-state error as ratios to what is tolerated. Below 1 passes."""
    q, k, v, a, b, A_log, dt_bias, state = probe_inputs(tokens, seed=1)
    got_y, got_states = gated_delta_kernel(q, k, v, a, b, A_log, dt_bias, state, every_row=True)
    y_error = state_error = 0.0
    for t in range(tokens):
        rows = slice(t, t + 1)
        want_y, state = gated_delta_update(q[:, rows], k[:, rows], v[:, rows], a[:, rows], b[:, rows],
                                           A_log, dt_bias, state, None, use_kernel=False)
        y_error = max(y_error, mx.max(mx.abs(got_y[:, rows].astype(mx.float32)
                                             - want_y.astype(mx.float32))).item())
        state_error = max(state_error, (mx.max(mx.abs(got_states[:, t] - state))
                                        / mx.max(mx.abs(state))).item())
    return max(y_error / Y_TOLERANCE, state_error / STATE_TOLERANCE)


def verify_path_name() -> str:
    """What /health and status say about a hybrid's GDN verify (`kernels.gdn_verify`)."""
    from mtplxd.engine.model import gdn_chunked

    return "CUDA kernel" if rows_usable() else gdn_chunked.path_name()


def usable() -> bool:
    """True on CUDA once the kernel has compiled and matched mlx-lm's ops on a probe (checked
    once per process; any failure is logged and leaves mlx-lm's path)."""
    global _usable
    if _usable is None:
        from mtplxd.engine.model.kv_cache import fixed_shapes_wanted

        wanted = os.environ.get("MTPLX_GDN_KERNEL", "1") != "0"
        _usable = wanted and fixed_shapes_wanted() and custom_kernels.probe(
            "gated delta step", probe_error, 1.0, "mlx-lm's gated delta ops")
    return _usable


def path_name() -> str:
    """What /health and status say about a hybrid's GDN decode step."""
    if usable():
        return "CUDA kernel"
    return "mlx-lm Metal kernel" if mx.metal.is_available() else "mlx-lm ops"


# What the probe tolerates: y to 0.05 (a bf16 output of about unit size), the state to 1e-3
# of its largest element.
Y_TOLERANCE = 0.05
STATE_TOLERANCE = 1e-3


def probe_error(tokens: int = 1) -> float:
    """The kernel against mlx-lm's ops on `probe_inputs` (2 key heads, 6 value heads, bf16,
    a float32 A_log), as a ratio to what is tolerated. Below 1 passes."""
    y_error, state_error = kernel_errors(probe_inputs(tokens))
    return max(y_error / Y_TOLERANCE, state_error / STATE_TOLERANCE)


def kernel_errors(inputs: tuple[mx.array, ...]) -> tuple[float, float]:
    """(y's largest absolute difference, the state's relative to its largest element): the
    kernel against mlx-lm's ops on one step's `inputs` (as `probe_inputs` gives them)."""
    q, k, v, a, b, A_log, dt_bias, state = inputs
    want_y, want_state = gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, None, use_kernel=False)
    got_y, got_state = gated_delta_kernel(q, k, v, a, b, A_log, dt_bias, state)
    y_error = mx.max(mx.abs(got_y.astype(mx.float32) - want_y.astype(mx.float32))).item()
    state_error = (mx.max(mx.abs(got_state - want_state)) / mx.max(mx.abs(want_state))).item()
    return y_error, state_error


def probe_inputs(tokens: int, key_dim: int = 64, value_dim: int = 32, key_heads: int = 2,
                 value_heads: int = 6, dtype: mx.Dtype = mx.bfloat16, seed: int = 0
                 ) -> tuple[mx.array, ...]:
    """Random inputs of one GDN layer's step, normalized as the layer normalizes them:
    (q, k, v, a, b, A_log (float32), dt_bias, state (float32)), all else in `dtype`."""
    from mlx_lm.models.gated_delta import normalize_qk

    keys = mx.random.split(mx.random.key(seed), 7)
    B, Hk, Hv = 1, key_heads, value_heads
    q = mx.random.normal((B, tokens, Hk, key_dim), key=keys[0]).astype(dtype)
    k = mx.random.normal((B, tokens, Hk, key_dim), key=keys[1]).astype(dtype)
    q, k = normalize_qk(q, k, inv_scale=key_dim**-0.5, eps=1e-6)
    v = mx.random.normal((B, tokens, Hv, value_dim), key=keys[2]).astype(dtype)
    a = mx.random.normal((B, tokens, Hv), key=keys[3]).astype(dtype)
    b = mx.random.normal((B, tokens, Hv), key=keys[4]).astype(dtype)
    A_log = mx.log(mx.random.uniform(1, 16, (Hv,), key=keys[5]))
    dt_bias = mx.ones((Hv,), dtype)
    state = mx.random.normal((B, Hv, value_dim, key_dim), key=keys[6]) * 0.1
    return q, k, v, a, b, A_log, dt_bias, state
