"""A checkpoint can name the MTP depth its head was tuned for; `depth = auto` uses it."""

from __future__ import annotations

import json
import shutil

from mtplxd.engine import load_model
from mtplxd.engine.model.loader import DEFAULT_DEPTH, MAX_DEPTH, recommended_depth
from mtplxd.models.builtin import EMBEDDED_MODEL_DIR


def test_checkpoint_recommended_depth_is_the_default_and_an_explicit_depth_wins(tiny_model_factory, tmp_path):
    folder = tmp_path / "tuned"
    shutil.copytree(tiny_model_factory("qwen3"), folder)
    assert load_model(folder).info.depth == DEFAULT_DEPTH
    config = json.loads((folder / "config.json").read_text())
    config["mtplx_default_depth"] = 2
    (folder / "config.json").write_text(json.dumps(config))
    assert load_model(folder).info.depth == 2
    assert load_model(folder, depth=4).info.depth == 4


def test_a_cuda_depth_applies_on_cuda_only(tiny_model_factory, tmp_path, monkeypatch):
    folder = tmp_path / "tuned"
    shutil.copytree(tiny_model_factory("qwen3"), folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(mtplx_default_depth=2, mtplx_cuda_default_depth=5)
    (folder / "config.json").write_text(json.dumps(config))
    assert load_model(folder).info.depth == 2
    monkeypatch.setattr("mtplxd.engine.loaded_model.fixed_shapes_wanted", lambda: True)  # "CUDA"
    assert load_model(folder).info.depth == 5
    assert load_model(folder, depth=1).info.depth == 1
    del config["mtplx_cuda_default_depth"]
    (folder / "config.json").write_text(json.dumps(config))
    assert load_model(folder).info.depth == 2  # no CUDA depth named: the plain one


def test_out_of_range_recommended_depths_fall_back_to_the_default():
    for bad in (-1, MAX_DEPTH + 1, True, "4", 2.5):
        assert recommended_depth({"mtplx_default_depth": bad}) == DEFAULT_DEPTH
        assert recommended_depth({"mtplx_cuda_default_depth": bad, "mtplx_default_depth": 2}, on_cuda=True) == 2


def test_the_embedded_model_defaults_to_the_depths_it_was_measured_best_at():
    config = json.loads((EMBEDDED_MODEL_DIR / "config.json").read_text())
    assert config["mtplx_default_depth"] == 3  # best on the CPU
    assert config["mtplx_cuda_default_depth"] == 6  # best measured on the H200
