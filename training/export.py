"""Write a TinyCoder checkpoint in the engine's dense-qwen3 MTP layout (HF names, mtp.*).

The device machine returns files of at most 16 MiB, so `save_shards` can split the weights;
`merge_shards` joins them back into the single model.safetensors that ships, and `install`
(the command line) turns a run's folder into the embedded model:

    python -m training.export RUN_DIR            # into mtplxd/models/embedded
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from training.mtp_model import TinyCoder, TinyCoderArgs


def checkpoint_config(args: TinyCoderArgs, eos_token_id: int, dtype: str) -> dict:
    """config.json contents for the engine and mlx-lm (standard qwen3 keys + mtp_num_hidden_layers)."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.num_hidden_layers,
        "intermediate_size": args.intermediate_size,
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads,
        "head_dim": args.head_dim,
        "rms_norm_eps": args.rms_norm_eps,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_position_embeddings,
        "rope_theta": args.rope_theta,
        "tie_word_embeddings": args.tie_word_embeddings,
        "mtp_num_hidden_layers": 1,
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "torch_dtype": dtype,
    }


def weights(model: TinyCoder, dtype: mx.Dtype) -> dict[str, mx.array]:
    """All parameters by their HF/contract names, cast to dtype (lm_head absent when tied)."""
    return {k: v.astype(dtype) for k, v in tree_flatten(model.parameters())}


def save_shards(model: TinyCoder, out_dir: Path, dtype: mx.Dtype, max_bytes: int = 15_000_000) -> list[Path]:
    """Save weights as model-0000N.safetensors files each below max_bytes; return the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, mx.array]] = [{}]
    size = 0
    for name, arr in sorted(weights(model, dtype).items()):
        if shards[-1] and size + arr.nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    paths = []
    for i, shard in enumerate(shards):
        path = out_dir / f"model-{i:05d}.safetensors"
        mx.save_safetensors(str(path), shard, metadata={"format": "mlx"})
        paths.append(path)
    return paths


def save_run(model: TinyCoder, args: TinyCoderArgs, out_dir: Path, eos_token_id: int) -> None:
    """A run's config.json and bfloat16 shards into out_dir; the model is left holding exactly
    the shipped weights (rounded to bfloat16), in float32, so what is evaluated next ships."""
    (out_dir / "config.json").write_text(json.dumps(checkpoint_config(args, eos_token_id, "bfloat16"), indent=2) + "\n")
    save_shards(model, out_dir, mx.bfloat16)
    model.set_dtype(mx.bfloat16)
    model.set_dtype(mx.float32)


def merge_shards(shard_paths: list[Path], dest: Path) -> None:
    """Join shards into one safetensors file."""
    merged: dict[str, mx.array] = {}
    for path in shard_paths:
        merged.update(mx.load(str(path)))
    mx.save_safetensors(str(dest), merged, metadata={"format": "mlx"})


def write_checkpoint(model: TinyCoder, args: TinyCoderArgs, tokenizer_dir: Path, dest: Path,
                     eos_token_id: int, dtype: mx.Dtype = mx.bfloat16) -> Path:
    """Write config.json, model.safetensors and the tokenizer files into dest."""
    dest.mkdir(parents=True, exist_ok=True)
    name = {mx.bfloat16: "bfloat16", mx.float16: "float16", mx.float32: "float32"}[dtype]
    (dest / "config.json").write_text(json.dumps(checkpoint_config(args, eos_token_id, name), indent=2) + "\n")
    mx.save_safetensors(str(dest / "model.safetensors"), weights(model, dtype), metadata={"format": "mlx"})
    for fname in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / fname, dest / fname)
    return dest


def load_checkpoint(path: Path) -> TinyCoder:
    """Load a checkpoint written by write_checkpoint into a TinyCoder (for tests and evaluation)."""
    cfg = json.loads((path / "config.json").read_text())
    keys = TinyCoderArgs.__dataclass_fields__
    args = TinyCoderArgs(**{k: v for k, v in cfg.items() if k in keys})
    model = TinyCoder(args)
    model.load_weights(list(mx.load(str(path / "model.safetensors")).items()), strict=True)
    mx.eval(model.parameters())
    return model


EMBEDDED = Path(__file__).resolve().parent.parent / "mtplxd" / "models" / "embedded"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def install(run_dir: Path, dest: Path = EMBEDDED, base: Path | None = None) -> Path:
    """Make dest a servable checkpoint from a training run's shards and config.json.

    The run's config wins for the model's keys; the serving keys (`mtplx_*`: default depths,
    the CUDA quantization) and the tokenizer come from `base` (default: dest itself), since a
    training run knows neither.
    """
    base = base or dest
    shards = sorted(run_dir.glob("model-*.safetensors"))
    if not shards:
        raise SystemExit(f"{run_dir} has no model-*.safetensors shards")
    config = json.loads((run_dir / "config.json").read_text())
    old = json.loads((base / "config.json").read_text())
    config.update({k: v for k, v in old.items() if k.startswith("mtplx_")})
    dest.mkdir(parents=True, exist_ok=True)
    merge_shards(shards, dest / "model.safetensors")
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if base.resolve() != dest.resolve():
        for fname in TOKENIZER_FILES:
            shutil.copy(base / fname, dest / fname)
    return dest


def main(argv: list[str] | None = None) -> None:
    """CLI entry: install a run's folder as a checkpoint (the embedded model by default)."""
    ap = argparse.ArgumentParser(description="Install a training run's shards as a servable checkpoint.")
    ap.add_argument("run_dir", type=Path, help="folder with model-*.safetensors and config.json")
    ap.add_argument("--dest", type=Path, default=EMBEDDED)
    a = ap.parse_args(argv)
    dest = install(a.run_dir, a.dest)
    print(f"installed {a.run_dir} into {dest}")


if __name__ == "__main__":
    main()
