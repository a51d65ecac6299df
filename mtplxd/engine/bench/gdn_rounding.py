"""How far a hybrid's logits move with the Gated DeltaNet form: the chunked form (CUDA's
verifies and prompts) and the per-token recurrence (every AR step), both in the model's
dtype, against the same weights in float32.

    python -m mtplxd.engine.bench.gdn_rounding [--size hybrid-27b-layers] [--dtype bf16]
        [--tokens 64,160] [--json-out FILE]

Why: on CUDA greedy MTP leaves greedy AR on a random-weight hybrid 27B at most tokens, and
a prefill (a third computation) ranks MTP's token above AR's by up to 0.71, more than a
near-tie (docs/benchmarks.md, "The GDN decode-step kernel on the H200"). A verify and a
prompt run the chunked form, an AR step the recurrence, so either form could be the one
that is off. Here both run over the same prompt, and the float32 model (the model's bf16 or
quantized weights cast up, the recurrence) stands for the exact logits: its two forms agree
to about 1e-4, so an error far above that is the model dtype's rounding.

For each prompt length: `max_abs_error` and `rms_error` of each form's last-position logits
against float32's, whether each picks float32's argmax, and the two forms' largest
difference from each other. The model is `bench.real_size`'s, random weights built in
memory; any device (the chunked form is forced on where it is not the default).
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
        return np.array(logits.reshape(-1).astype(mx.float32)).astype(np.float64)
    finally:
        gdn_chunked.force(None)


def to_float32(model: Any) -> None:
    """Cast every floating weight of `model` to float32 in place (quantized weights are
    dequantized by mlx.nn's own `dequantize` first)."""
    import mlx.nn as nn
    from mlx.utils import tree_map

    for name, module in list(model.named_modules()):
        if isinstance(module, nn.QuantizedLinear):
            weight = mx.dequantize(module.weight, module.scales, module.biases,
                                   module.group_size, module.bits)
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in module)
            linear.weight = weight
            if "bias" in module:
                linear.bias = module.bias
            _replace(model, name, linear)
        elif isinstance(module, nn.QuantizedEmbedding):
            embedding = nn.Embedding(*module.weight.shape[:1], module.dims)
            embedding.weight = mx.dequantize(module.weight, module.scales, module.biases,
                                             module.group_size, module.bits)
            _replace(model, name, embedding)
    model.update(tree_map(lambda x: x.astype(mx.float32) if mx.issubdtype(x.dtype, mx.floating) else x,
                          model.parameters()))


def _replace(model: Any, dotted: str, module: Any) -> None:
    """Set the submodule at `dotted` (as named_modules names it) to `module`."""
    *parents, leaf = dotted.split(".")
    owner = model
    for part in parents:
        owner = owner[int(part)] if part.isdigit() else getattr(owner, part)
    if leaf.isdigit():
        owner[int(leaf)] = module
    else:
        setattr(owner, leaf, module)


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


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    from mtplxd.engine.bench.real_size import DTYPES, SIZES

    parser = bench_parser(PROG, __doc__)
    parser.add_argument("--size", default="hybrid-27b-layers",
                        choices=[name for name, (family, _) in SIZES.items() if family != "qwen3"])
    parser.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    parser.add_argument("--tokens", default="64,160", help="prompt lengths, comma-separated")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    try:
        lengths = [int(n) for n in args.tokens.split(",") if n.strip()]
    except ValueError:
        parser.error(f"--tokens: comma-separated whole numbers, not {args.tokens!r}")
    if not lengths or min(lengths) < 1:
        parser.error("--tokens: at least one length, each 1 or more")
    report = {"bench": "gdn_rounding", **machine(), "size": args.size, "dtype": args.dtype,
              "lengths": compare(args.size, args.dtype, lengths), "command": command_line(PROG, argv)}
    return print_and_save(report, args.json_out)


if __name__ == "__main__":
    raise SystemExit(main())
