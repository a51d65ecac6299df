"""`mtplxctl tune` against a real daemon: it times every depth through the API and saves the
best under the key the daemon reports; the daemon serves a saved depth at the next load with
depth = auto, and the save and the lookup go through one key function, so they cannot drift
apart. It refuses plainly when there is nothing to tune."""

from __future__ import annotations

import json

import pytest

from mtplxd.tuning import machine_identity, read_tuning, save_tuned, tuned_depth, tuning_key
from support.api_daemon import ctl_in, start_api_daemon


@pytest.fixture(scope="module")
def tuned(tiny_checkpoint, tmp_path_factory):
    home = tmp_path_factory.mktemp("tune-home")
    daemon = start_api_daemon(home, MTPLX_MODEL=str(tiny_checkpoint))
    try:
        result = ctl_in(home, "tune", "--depths", "0-3", "--max-tokens", "16", "--repeats", "1", "--json")
        yield daemon, result
    finally:
        daemon.stop()


def test_tune_times_each_depth_and_saves_the_best_under_the_daemons_key(tuned):
    daemon, result = tuned
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert list(report["by_depth"]) == ["0", "1", "2", "3"]
    # Interleaved: each prompt ran every depth once, in a rotating order.
    assert len(report["runs"]) == 4 * report["prompts"]
    first_depths = [r["depth"] for r in report["runs"] if r["prompt"] == 0]
    assert sorted(first_depths) == [0, 1, 2, 3]
    assert report["by_depth"]["0"]["ratio_to_ar"] == 1.0
    assert all(e["tok_s_median"] > 0 for e in report["by_depth"].values())
    best = max(report["by_depth"].values(), key=lambda e: e["tok_s_median"])
    assert report["by_depth"][str(report["depth"])] == best
    key = daemon.client.call("daemon.status")["model"]["tuning_key"]
    assert report["tuning_key"] == key
    assert tuned_depth(daemon.home, key) == report["depth"]
    assert json.loads(open(report["report"]).read())["depth"] == report["depth"]


def test_the_next_load_serves_the_saved_depth(tuned):
    daemon, _ = tuned
    status = daemon.client.call("daemon.status")["model"]
    # A depth no default would pick, saved under the key the daemon reported...
    save_tuned(daemon.home, status["tuning_key"], {"depth": 5})
    reloaded = daemon.client.call("model.load", {})
    # ...is what the same daemon finds when it computes the key again at load.
    assert reloaded["depth"] == 5 and reloaded["depth_source"] == "tuned"
    # An explicit depth still wins over the tuned one.
    explicit = daemon.client.call("model.load", {"depth": 2})
    assert explicit["depth"] == 2 and explicit["depth_source"] == "setting"


def test_one_key_function_names_model_and_machine(tmp_path):
    info = {"id": "qwen", "quantization": "8bit", "dtype": "bfloat16", "decode_loop": "fused", "depth": 3}
    key = tuning_key(info)
    assert key == tuning_key({**info, "depth": 1})  # the served depth is not part of it
    assert key.endswith("@" + machine_identity())
    for field, other in (("id", "qwen-b"), ("quantization", "4bit"), ("dtype", "float32"),
                         ("decode_loop", "stepwise")):
        assert tuning_key({**info, field: other}) != key
    assert tuning_key(info, machine="Darwin-arm64-16cpu-128GiB") != key
    save_tuned(tmp_path, key, {"depth": 4})
    save_tuned(tmp_path, tuning_key(info, machine="other"), {"depth": 1})
    assert tuned_depth(tmp_path, key) == 4 and len(read_tuning(tmp_path)) == 2
    (tmp_path / "tuning.json").write_text("{not json")
    assert tuned_depth(tmp_path, key) is None


def test_tune_says_plainly_when_there_is_nothing_to_tune(tmp_path):
    daemon = start_api_daemon(tmp_path / "home", "--no-model", wait_model=False)
    try:
        result = ctl_in(daemon.home, "tune")
        assert result.returncode == 1
        assert "no model is loaded, so there is nothing to tune" in result.stderr
        bad = ctl_in(daemon.home, "tune", "--depths", "two")
        assert bad.returncode == 1 and "--depths two must be a range like 0-6" in bad.stderr
    finally:
        daemon.stop()
