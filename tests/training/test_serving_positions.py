"""training.serving_positions: the serving engine's loss by position equals the training
model's (training.evaluate.loss_by_position) on the same window of the shipped model."""

from __future__ import annotations

import json

import numpy as np
import pytest

from training import evaluate, serving_positions
from training.long_context import load_init
from training.train import TrainConfig

EMBEDDED = serving_positions.REPO / "mtplxd" / "models" / "embedded"


def test_the_serving_path_scores_a_window_as_the_training_model_does(tmp_path):
    # A window of real-looking ids: the shipped tokenizer's encoding of this very file.
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(EMBEDDED / "tokenizer.json")).encode(open(__file__).read()).ids
    tokens = np.array((ids * 8)[:1200], dtype=np.int32)
    length = 1100  # one prefill chunk over more than 256 keys: the CPU's numpy attention
    served = serving_positions.serving_loss_by_position(EMBEDDED, tokens, length)
    cfg = TrainConfig(preset="coder-deep", rope_theta=1e6, max_position_embeddings=65536)
    edges = [b["from"] for b in served["buckets"]] + [length]
    trained = evaluate.loss_by_position(load_init(EMBEDDED, cfg), tokens, length, 1, 256, edges)
    assert [b["to"] for b in served["buckets"]] == [1024, 1100]
    for got, want in zip(served["buckets"], trained["buckets"]):
        assert got["loss"] == pytest.approx(want["loss"], abs=2e-3)
    with pytest.raises(ValueError, match="cannot fill"):
        serving_positions.serving_loss_by_position(EMBEDDED, tokens, 1200)


def test_the_command_writes_its_report(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    np.savez(data / "tokens.npz", code_heldout=np.arange(3, 200, dtype=np.int32))
    out = tmp_path / "positions.json"
    serving_positions.main(["--data", str(data), "--length", "100", "--json-out", str(out)])
    report = json.loads(out.read_text())
    assert report["length"] == 100 and report["start"] == 0
    assert [(b["from"], b["to"]) for b in report["buckets"]] == [(0, 100)]
    assert all(b["loss"] > 0 for b in report["buckets"])
