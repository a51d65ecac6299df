"""The training code of the shipped model runs on CPU and learns (tiny config, a few steps)."""

import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from training import pack
from training.train import TrainConfig, load_data, train

from .conftest import EMBEDDED_DIR, REPO_ROOT


def write_tiny_data(dest: Path) -> Path:
    """Pack a little real Python (this repo's training code) and a few chat pairs."""
    tok = Tokenizer.from_file(str(EMBEDDED_DIR / "tokenizer.json"))
    code = [p.read_text() for p in sorted((REPO_ROOT / "training").glob("*.py"))]
    chat = [f"<|im_start|>user\nWrite a Python function that adds {i}.<|im_end|>\n"
            f"<|im_start|>assistant\n```python\ndef add_{i}(x):\n    return x + {i}\n```<|im_end|>\n"
            for i in range(40)]
    arrays = {"code_train": pack.encode_stream(tok, code), "code_heldout": pack.encode_stream(tok, code[:1]),
              "chat_train": pack.encode_stream(tok, chat), "chat_heldout": pack.encode_stream(tok, chat[:4])}
    dest.mkdir(parents=True)
    np.savez_compressed(dest / "tokens.npz", **arrays)
    meta = {"vocab_size": tok.get_vocab_size(),
            "special_ids": {t: tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_end|>")}}
    (dest / "meta.json").write_text(json.dumps(meta))
    return dest


def test_joint_loss_falls_in_a_few_steps_on_the_tiny_config(tmp_path):
    arrays, meta = load_data(write_tiny_data(tmp_path / "data"))
    cfg = TrainConfig(preset="tiny", steps=20, batch=2, seq_len=16, warmup=3, lr=5e-3)
    model, history = train(cfg, arrays, meta, log=lambda _msg: None)
    first, last = history["parts"][0], history["parts"][-1]
    # Every head learns: next-token and each MTP draft step.
    assert history["steps"] == 20
    assert all(l < f - 0.5 for f, l in zip(first, last)), (first, last)
    assert len(first) == 1 + len(cfg.mtp_weights)
