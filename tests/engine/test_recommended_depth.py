"""A checkpoint can name the MTP depth its head was tuned for; `depth = auto` uses it."""

from __future__ import annotations

import json
import shutil

from mtplxd.engine import load_model
from mtplxd.engine.loader import DEFAULT_DEPTH
from mtplxd.runtime import EMBEDDED_MODEL_DIR


def test_checkpoint_recommended_depth_is_the_default_and_an_explicit_depth_wins(tiny_model_factory, tmp_path):
    folder = tmp_path / "tuned"
    shutil.copytree(tiny_model_factory("qwen3"), folder)
    assert load_model(folder).info.depth == DEFAULT_DEPTH
    config = json.loads((folder / "config.json").read_text())
    config["mtplx_default_depth"] = 2
    (folder / "config.json").write_text(json.dumps(config))
    assert load_model(folder).info.depth == 2
    assert load_model(folder, depth=4).info.depth == 4


def test_the_embedded_model_defaults_to_the_depth_it_was_measured_best_at():
    config = json.loads((EMBEDDED_MODEL_DIR / "config.json").read_text())
    assert config["mtplx_default_depth"] == 3  # best on the CPU, second-best on the H200
