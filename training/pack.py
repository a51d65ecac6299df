"""Tokenize the corpus and the instruction pairs into flat uint16 token streams for training.

Each corpus file becomes `<file text><|endoftext|>`; each pair is its rendered ChatML text
followed by `<|endoftext|>`. Output (np.savez_compressed, one file): code_train, code_heldout,
chat_train, chat_heldout, plus meta.json with counts and the tokenizer's special ids. The
training script (training/train.py) reads only this folder, so the GPU machine needs no
tokenizer library.

    python -m training.pack --corpus train-out/corpus --pairs train-out/pairs \
        --tokenizer train-out/tokenizer --out train-out/data
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from training.tokenizer_train import SPECIAL_TOKENS, read_texts


# Chat prompts (as the shipped template renders them) that train.py completes greedily after
# training, so a GPU run shows what the model answers; ids because that machine has no tokenizer.
PROBES = [
    "<|im_start|>user\nWrite a Python function that returns the n-th Fibonacci number<|im_end|>\n"
    "<|im_start|>assistant\n",
    "<|im_start|>user\nWrite a Python function that returns the n-th Fibonacci number<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n",
    "<|im_start|>user\nWrite a Python function that checks if a string is a valid IPv4 address.<|im_end|>\n"
    "<|im_start|>assistant\n",
]


def encode_stream(tok: Tokenizer, texts: list[str], batch: int = 512) -> np.ndarray:
    """Concatenate the encodings of texts, each followed by <|endoftext|>, as uint16."""
    eot = tok.token_to_id("<|endoftext|>")
    assert tok.get_vocab_size() <= 65536
    chunks = []
    for i in range(0, len(texts), batch):
        for enc in tok.encode_batch(texts[i:i + batch], add_special_tokens=False):
            chunks.append(np.asarray(enc.ids + [eot], dtype=np.uint16))
    return np.concatenate(chunks) if chunks else np.zeros(0, np.uint16)


def build(corpus_dir: Path, pairs_dir: Path, tokenizer_dir: Path, out_dir: Path) -> dict:
    """Write tokens.npz and meta.json into out_dir; return the meta dict."""
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    streams = {
        "code_train": list(read_texts([corpus_dir / "train.jsonl"])),
        "code_heldout": list(read_texts([corpus_dir / "heldout.jsonl"])),
        "chat_train": list(read_texts([pairs_dir / "pairs_train.jsonl"])),
        "chat_heldout": list(read_texts([pairs_dir / "pairs_heldout.jsonl"])),
    }
    arrays = {name: encode_stream(tok, texts) for name, texts in streams.items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out_dir / "tokens.npz", **arrays)
    meta = {
        "vocab_size": tok.get_vocab_size(),
        "special_ids": {t: tok.token_to_id(t) for t in SPECIAL_TOKENS},
        "tokens": {name: int(a.size) for name, a in arrays.items()},
        "bytes_per_token_code_train": round(
            sum(len(t.encode()) for t in streams["code_train"]) / max(1, arrays["code_train"].size), 3),
    }
    meta["probes"] = [{"prompt": p, "ids": tok.encode(p, add_special_tokens=False).ids} for p in PROBES]
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def main() -> None:
    """CLI entry."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=Path, default=Path("train-out/corpus"))
    ap.add_argument("--pairs", type=Path, default=Path("train-out/pairs"))
    ap.add_argument("--tokenizer", type=Path, default=Path("train-out/tokenizer"))
    ap.add_argument("--out", type=Path, default=Path("train-out/data"))
    args = ap.parse_args()
    print(json.dumps(build(args.corpus, args.pairs, args.tokenizer, args.out)))


if __name__ == "__main__":
    main()
