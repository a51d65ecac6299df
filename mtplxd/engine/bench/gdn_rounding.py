"""How far a hybrid's logits move with the Gated DeltaNet form: the chunked form (CUDA's
verifies and prompts) and the per-token recurrence (every AR step), both in the model's
dtype, against the same weights in float32.

    python -m mtplxd.engine.bench.gdn_rounding [--size hybrid-27b-layers] [--dtype bf16]
        [--tokens 64,160] [--layer-tokens 1,4,32,96] [--json-out FILE]

Why: on CUDA greedy MTP leaves greedy AR on a random-weight hybrid 27B at most tokens, and
a prefill (a third computation) ranks MTP's token above AR's by up to 0.71, more than a
near-tie (docs/benchmarks.md, "The GDN decode-step kernel on the H200"). A verify and a
prompt run the chunked form, an AR step the recurrence, so either form could be the one
that is off. Here both run over the same prompt, and the float32 model (the model's bf16 or
quantized weights cast up, the recurrence) stands for the exact logits: its two forms agree
to about 1e-4, so an error far above that is the model dtype's rounding.

For each prompt length: `max_abs_error` and `rms_error` of each form's last-position logits
against float32's, whether each picks float32's argmax, and the two forms' largest
difference from each other. `one_layer_27b_shapes`: one GDN layer alone at the hybrid 27B's
heads and dims (`--layer-tokens` tokens, bf16 inputs), each form's y and state against a
float64 recurrence: whether a single layer's arithmetic already parts the forms. The model
is `bench.real_size`'s, random weights built in memory; any device (the chunked form is
forced on where it is not the default).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from mtplxd.engine.bench.harness import bench_parser, command_line, machine, print_and_save

PROG = "python -m mtplxd.engine.bench.gdn_rounding"
FORMS = {"chunked": True, "per_token": False}  # name -> gdn_chunked.force value


def last_logits(trunk: Any, ids: list[int], chunked: bool) -> np.ndarray:
    """The prompt's last-position logits (float64) with the GDN layers in one form."""
    from mtplxd.engine.model import gdn_chunked

    gdn_chunked.force(chunked)
    try:
        _, logits = trunk.prefill(ids, trunk.make_cache())
        return _f64(logits.reshape(-1))
    finally:
        gdn_chunked.force(None)


def to_float32(model: Any) -> None:
    """Cast every floating weight of `model` to float32 in place (quantized weights are
    dequantized by mlx.nn's own `dequantize` first)."""
    import mlx.nn as nn
    from mlx.utils import tree_unflatten

    def dequantized(module: Any) -> mx.array:
        return mx.dequantize(module.weight, module.scales, module.biases, module.group_size, module.bits)

    replacements = []
    for name, module in model.named_modules():
        if isinstance(module, nn.QuantizedLinear):
            weight = dequantized(module)
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in module)
            linear.weight = weight
            if "bias" in module:
                linear.bias = module.bias
            replacements.append((name, linear))
        elif isinstance(module, nn.QuantizedEmbedding):
            embedding = nn.Embedding(module.weight.shape[0], module.dims)
            embedding.weight = dequantized(module)
            replacements.append((name, embedding))
    model.update_modules(tree_unflatten(replacements))
    model.set_dtype(mx.float32)


def compare(size: str, dtype: str, lengths: list[int], seed: int = 1) -> list[dict[str, Any]]:
    """Per prompt length, each form's logits in `dtype` against float32's (module docstring)."""
    from mtplxd.engine.bench.real_size import build_model
    from mtplxd.engine.model.trunk import Trunk

    model, spec = build_model(size, dtype)
    trunk = Trunk(model, spec)
    vocab = trunk.text.args.vocab_size
    prompts = {n: mx.random.randint(0, vocab, (n,), key=mx.random.key(seed)).tolist() for n in lengths}
    low = {n: {form: last_logits(trunk, ids, chunked) for form, chunked in FORMS.items()}
           for n, ids in prompts.items()}
    to_float32(model)
    trunk = Trunk(model, spec)  # over the float32 modules
    rows = []
    for n, ids in prompts.items():
        truth = last_logits(trunk, ids, chunked=False)
        float32_chunked = last_logits(trunk, ids, chunked=True)
        row: dict[str, Any] = {"tokens": n, "float32_forms_max_difference": float(np.abs(float32_chunked - truth).max())}
        for form, logits in low[n].items():
            error = logits - truth
            row[form] = {"max_abs_error": float(np.abs(error).max()),
                         "rms_error": float(np.sqrt(np.mean(error ** 2))),
                         "argmax_is_float32s": bool(logits.argmax() == truth.argmax())}
        row["forms_max_difference"] = float(np.abs(low[n]["chunked"] - low[n]["per_token"]).max())
        rows.append(row)
    return rows


def one_layer(tokens: int, seed: int = 0, dtype: mx.Dtype = mx.bfloat16) -> dict[str, Any]:
    """One GDN layer's step over `tokens` tokens at the hybrid 27B's shapes (16 key and 48
    value heads of 128, mlx-lm's A_log init, inputs in `dtype`), each form against a float64
    recurrence on the same inputs: the largest error of y and of the state (relative to its
    largest element)."""
    from mlx_lm.models.gated_delta import gated_delta_update

    from mtplxd.engine.model import gdn_chunked, gdn_kernel

    q, k, v, a, b, _, dt_bias, state = gdn_kernel.probe_inputs(
        tokens, key_dim=128, value_dim=128, key_heads=16, value_heads=48, dtype=dtype, seed=seed)
    A_log = mx.log(mx.random.uniform(0, 16, (48,), key=mx.random.key(seed + 1)))  # mlx-lm's init
    want_y, want_state = _float64_recurrence(q, k, v, a, b, A_log, dt_bias, state)
    forms = {
        "per_token": gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, None, use_kernel=False),
        "chunked": gdn_chunked.chunked_prefill(q, k, v, gdn_chunked.log_decay(A_log, a, dt_bias),
                                               mx.sigmoid(b), state),
    }
    row: dict[str, Any] = {"tokens": tokens, "y_max_abs": float(np.abs(want_y).max())}
    for form, (y, s) in forms.items():
        y64, s64 = _f64(y), _f64(s)
        row[form] = {"y_max_abs_error": float(np.abs(y64 - want_y).max()),
                     "state_max_relative_error": float(np.abs(s64 - want_state).max() / np.abs(want_state).max())}
    return row


def _f64(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32)).astype(np.float64)


def _float64_recurrence(q, k, v, a, b, A_log, dt_bias, state) -> tuple[np.ndarray, np.ndarray]:
    """The gated delta rule token by token in float64 (mlx-lm's gated_delta_ops' algebra)."""
    q, k, v, a, b, dt_bias, s = (_f64(x) for x in (q, k, v, a, b, dt_bias, state))
    decay_rate = np.exp(_f64(A_log))
    repeat = v.shape[2] // k.shape[2]
    ys = np.zeros(v.shape)
    for t in range(k.shape[1]):
        g = np.exp(-decay_rate * np.logaddexp(a[:, t] + dt_bias, 0.0))  # (B, Hv)
        beta = 1.0 / (1.0 + np.exp(-b[:, t]))
        kt, qt = np.repeat(k[:, t], repeat, axis=1), np.repeat(q[:, t], repeat, axis=1)
        s = s * g[..., None, None]
        delta = (v[:, t] - np.einsum("bhvk,bhk->bhv", s, kt)) * beta[..., None]
        s = s + delta[..., None] * kt[..., None, :]
        ys[:, t] = np.einsum("bhvk,bhk->bhv", s, qt)
    return ys, s


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    from mtplxd.engine.bench.real_size import DTYPES, SIZES

    parser = bench_parser(PROG, __doc__)
    parser.add_argument("--size", default="hybrid-27b-layers",
                        choices=[name for name, (family, _) in SIZES.items() if family != "qwen3"])
    parser.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    parser.add_argument("--tokens", default="64,160", help="prompt lengths, comma-separated")
    parser.add_argument("--layer-tokens", default="1,4,32,96",
                        help="token counts of the one-layer check at the 27B's shapes ('' for none)")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    lengths, layer_tokens = (_counts(parser, flag, value) for flag, value in
                             (("--tokens", args.tokens), ("--layer-tokens", args.layer_tokens)))
    if not lengths:
        parser.error("--tokens: at least one length")
    report = {"bench": "gdn_rounding", **machine(), "size": args.size, "dtype": args.dtype,
              "lengths": compare(args.size, args.dtype, lengths),
              "one_layer_27b_shapes": [one_layer(n) for n in layer_tokens],
              "command": command_line(PROG, argv)}
    return print_and_save(report, args.json_out)


def _counts(parser: Any, flag: str, value: str) -> list[int]:
    """A comma-separated list of whole numbers, each 1 or more (a usage error otherwise)."""
    try:
        counts = [int(n) for n in value.split(",") if n.strip()]
    except ValueError:
        parser.error(f"{flag}: comma-separated whole numbers, not {value!r}")
    if any(n < 1 for n in counts):
        parser.error(f"{flag}: each count 1 or more")
    return counts


if __name__ == "__main__":
    raise SystemExit(main())
