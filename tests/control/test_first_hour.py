"""The first hour of a new user (issue #21): every start-up failure reads as one sentence that
says what to do, with a non-zero exit and no traceback."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
from pathlib import Path

from support.daemon import run_ctl


def test_port_in_use_names_the_holder_and_the_fix():
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        result = run_ctl("start", "--port", str(port))
    finally:
        holder.close()
    assert result.returncode != 0
    message = result.stderr
    assert f"port {port} is in use by PID {os.getpid()} (" in message, message
    assert f"--port {port + 1}" in message and "Traceback" not in message
    assert len([line for line in message.splitlines() if line.strip()]) <= 2


def test_an_unusable_mtplx_home_is_one_sentence_naming_the_path(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("MTPLX_HOME", str(blocker / "home"))
    for args in (["start"], ["config", "set", "depth", "2"]):
        result = run_ctl(*args)
        assert result.returncode == 1, (args, result.stderr)
        assert "Traceback" not in result.stderr, result.stderr
        assert str(blocker) in result.stderr and "MTPLX_HOME" in result.stderr, result.stderr


def _broken_copy(model: Path, where: Path) -> Path:
    """A model folder that resolves but fails to load (its weights are cut short)."""
    broken = where / "broken-model"
    shutil.copytree(model, broken)
    for weights in broken.glob("*.safetensors"):
        weights.write_bytes(weights.read_bytes()[:100])
    return broken


def test_a_failed_load_keeps_serving_the_last_good_model_and_says_so(tiny_model_factory, tmp_path):
    good = tiny_model_factory("qwen3")
    broken = _broken_copy(good, tmp_path)
    started = run_ctl("start", "--port", "0", "--model", str(good))
    assert started.returncode == 0, started.stderr
    try:
        # The model line reads as status's does.
        line = next(line for line in started.stdout.splitlines() if line.startswith("model "))
        assert line.startswith(f"model {good.name} — MTP depth"), line
        assert not re.search(r"\([^)]*\(", line), line  # no "(... (...)": parentheses never nest
        failed = run_ctl("start", "--model", str(broken))
        assert failed.returncode == 1 and "Traceback" not in failed.stderr
        assert f"still serving the previous model {good.name}" in " ".join(failed.stderr.split())
        model = json.loads(run_ctl("status", "--json").stdout)["model"]
        assert (model["state"], model["id"]) == ("loaded", good.name)
        assert "broken-model" in model["error"]
    finally:
        run_ctl("stop")


def test_after_a_failed_first_load_a_plain_start_loads_the_default(tiny_model_factory, tmp_path,
                                                                    monkeypatch):
    default = tiny_model_factory("qwen3")
    monkeypatch.setenv("MTPLX_MODEL", str(default))
    failed = run_ctl("start", "--port", "0", "--model", str(_broken_copy(default, tmp_path)))
    try:
        assert failed.returncode == 1 and "mtplxctl start` loads the default" in failed.stderr
        again = run_ctl("start", "--json")
        assert again.returncode == 0, again.stderr
        model = json.loads(again.stdout)["model"]
        assert (model["state"], model["id"]) == ("loaded", default.name)
    finally:
        run_ctl("stop")


def test_config_set_says_when_a_change_applies_and_applies_depth_now(tiny_model_factory):
    model = tiny_model_factory("qwen3")
    assert run_ctl("start", "--port", "0", "--model", str(model)).returncode == 0
    try:
        depth = run_ctl("config", "set", "depth", "4")
        assert depth.returncode == 0 and "applied now" in depth.stdout, depth.stdout
        assert json.loads(run_ctl("status", "--json").stdout)["model"]["depth"] == 4
        limit = run_ctl("config", "set", "memory_limit", "8")
        assert "takes effect at the next model load (`mtplxctl restart`)" in limit.stdout
        port = run_ctl("config", "set", "port", "8123", "--json")
        assert json.loads(port.stdout)["applies"] == "restart"
    finally:
        run_ctl("stop")


def test_config_errors_are_plain_sentences_and_values_print_as_toml():
    for args, expected in [
        (("config", "set", "port", "eighty"), 'port cannot be "eighty": it must be a whole number from 0 to 65535'),
        (("config", "set", "memory_limit", "lots"), 'memory_limit cannot be "lots": it must be auto, max or a positive number of GiB'),
        (("config", "set", "dpeth", "2"), "there is no setting named dpeth; the settings are"),
        (("config", "get", "dpeth"), "there is no setting named dpeth"),
    ]:
        result = run_ctl(*args)
        assert result.returncode == 1 and expected in result.stderr, (args, result.stderr)
        for internal in ("Error:", "invalid literal", "could not convert", "Traceback", "'"):
            assert internal not in result.stderr, (args, result.stderr)
        assert f"`mtplxctl {' '.join(args)}`" not in result.stderr  # no hint to rerun what failed
    assert run_ctl("config", "set", "cors_origins", "http://a,http://b").returncode == 0
    shown = run_ctl("config", "get").stdout
    assert '"auto"' in shown and '["http://a", "http://b"]' in shown and "'auto'" not in shown


def test_a_bad_number_on_the_command_line_says_what_it_takes():
    result = run_ctl("start", "--port", "eighty")
    assert result.returncode == 2
    assert "--port: must be a whole number from 0 to 65535, not eighty" in result.stderr
    assert "invalid int value" not in result.stderr and "'" not in result.stderr
