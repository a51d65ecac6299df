"""Train the byte-level BPE tokenizer of mtplx-tiny-coder and write it in Hugging Face layout.

Writes tokenizer.json and tokenizer_config.json (ChatML specials, `<think>`/`</think>`,
`<tool_call>`/`</tool_call>`, and the Qwen-style chat template of chat_template.jinja, which
supports tools and `enable_thinking`). mlx_lm and transformers' AutoTokenizer load the folder.

    python -m training.tokenizer_train --corpus train-out/corpus --pairs train-out/pairs \
        --out train-out/tokenizer
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
                  "<tool_call>", "</tool_call>"]
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")


def read_texts(paths: Iterable[Path]) -> Iterator[str]:
    """Yield the "text" field of every line of the given JSONL files."""
    for path in paths:
        with open(path) as f:
            for line in f:
                yield json.loads(line)["text"]


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192) -> Tokenizer:
    """Byte-level BPE (GPT-2 pre-tokenization) with the special tokens at ids 0..6."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2,
                                  special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


def tokenizer_config(tok: Tokenizer, model_max_length: int) -> dict:
    """tokenizer_config.json contents: specials, EOS/PAD and the chat template."""
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False,
                                        "rstrip": False, "single_word": False, "special": True}
             for t in SPECIAL_TOKENS}
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in (EOS_TOKEN, PAD_TOKEN)],
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "split_special_tokens": False,
        "chat_template": TEMPLATE_PATH.read_text(),
    }


def save(tok: Tokenizer, out_dir: Path, model_max_length: int = 4096) -> None:
    """Write tokenizer.json and tokenizer_config.json into out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = tokenizer_config(tok, model_max_length)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def main() -> None:
    """CLI entry: train on corpus train split + training pairs, write to --out."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=Path, default=Path("train-out/corpus"))
    ap.add_argument("--pairs", type=Path, default=Path("train-out/pairs"))
    ap.add_argument("--out", type=Path, default=Path("train-out/tokenizer"))
    ap.add_argument("--vocab-size", type=int, default=8192)
    args = ap.parse_args()
    texts = read_texts([args.corpus / "train.jsonl", args.pairs / "pairs_train.jsonl"])
    tok = train_tokenizer(texts, args.vocab_size)
    save(tok, args.out)
    print(f"vocab {tok.get_vocab_size()} -> {args.out}")


if __name__ == "__main__":
    main()
