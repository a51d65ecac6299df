"""A real daemon serving a 4-bit checkpoint (bfloat16 scales, as mlx-community ships them) on
the Linux CPU. With its weights kept packed (config.toml `dequantize = "off"`) it computes in
float32, decodes AR by default and says why in /health and `mtplxctl status`, and a request
that asks for MTP still gets it. Then `config set dequantize auto` and a model load: the
weights are dense float32, MTP is on by default, and both surfaces say so."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest

from mtplxctl.output import human_bytes
from mtplxd.engine.fixtures.tiny import write_tiny_checkpoint
from mtplxd.engine.model.loader import QUANTIZED_CPU_DEPTH_REASON
from mtplxd.engine.loaded_model import DEQUANTIZED_LABEL, DEQUANTIZED_PATH
from support.api_daemon import ApiDaemon, ctl_in, paths_for, serving

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the Linux CPU's rule")
MODEL = "tiny-q4"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("models") / MODEL, "qwen3",
                                 quantize_bits=4, torch_dtype="bfloat16")


@pytest.fixture(scope="module")
def daemon(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiDaemon]:
    home = tmp_path_factory.mktemp("home")
    config = paths_for(home).config_file
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text('dequantize = "off"\n')
    with serving(checkpoint, home) as running:
        yield running


def ask(daemon: ApiDaemon, **extra) -> openai.types.chat.ChatCompletion:
    with openai.OpenAI(base_url=daemon.base_url + "/v1", api_key="x", max_retries=0) as client:
        return client.chat.completions.create(
            model=MODEL, max_tokens=12, temperature=0,
            messages=[{"role": "user", "content": "add two numbers"}], extra_body={"ignore_eos": True, **extra})


def test_health_says_ar_by_default_and_why(daemon):
    health = httpx.get(daemon.base_url + "/health").json()
    assert health["mode"] == "mtp" and health["depth"] == 0
    assert health["depth_reason"] == QUANTIZED_CPU_DEPTH_REASON
    assert {"what": "mtp_depth", "why": QUANTIZED_CPU_DEPTH_REASON} in health["degradations"]
    model = daemon.client.call("daemon.status")["model"]
    assert model["dtype"] == "float32" and model["quantization"]


def test_a_request_runs_ar_unless_it_asks_for_a_depth(daemon):
    plain, asked = ask(daemon), ask(daemon, mtp_depth=2)
    assert plain.model_extra["mtplx_stats"]["depth"] == 0 and plain.model_extra["mtplx_stats"]["drafted"] == 0
    assert asked.model_extra["mtplx_stats"]["depth"] == 2 and asked.model_extra["mtplx_stats"]["drafted"] > 0
    assert asked.choices[0].message.content == plain.choices[0].message.content


def test_status_shows_the_reason(daemon):
    shown = ctl_in(daemon.home, "status")
    assert shown.returncode == 0, shown.stderr
    assert f"MTP depth 0 ({QUANTIZED_CPU_DEPTH_REASON})" in " ".join(shown.stdout.split())


def test_a_depth_set_while_serving_replaces_the_default_and_its_reason(daemon):
    assert daemon.client.call("config.set", {"key": "depth", "value": 2})["value"] == 2
    health = httpx.get(daemon.base_url + "/health").json()
    assert health["depth"] == 2 and health["depth_reason"] is None
    assert all(item["what"] != "mtp_depth" for item in health["degradations"])
    assert ask(daemon).model_extra["mtplx_stats"]["depth"] == 2


def test_dequantize_auto_applies_at_the_next_load(daemon, checkpoint):
    """`config set dequantize auto` says it applies at the next model load, and it does: the
    reloaded model's weights are dense float32, MTP is its default, and /health, the kernels
    and `mtplxctl status` say so."""
    changed = daemon.client.call("config.set", {"key": "dequantize", "value": "auto"})
    assert changed["applies"] == "next_load"
    daemon.client.call("config.set", {"key": "depth", "value": "auto"})  # the model's own default
    daemon.client.call("model.load", {"model": str(checkpoint)}, timeout=120)
    health = httpx.get(daemon.base_url + "/health").json()
    assert health["depth"] > 0 and health["depth_reason"] is None
    assert all(item["what"] != "mtp_depth" for item in health["degradations"])
    assert health["model_info"]["quantization"] == "4bit" + DEQUANTIZED_LABEL
    assert health["kernels"]["quantized_matmul"] == DEQUANTIZED_PATH
    stats = ask(daemon).model_extra["mtplx_stats"]
    assert stats["depth"] == health["depth"] and stats["drafted"] > 0
    shown = " ".join(ctl_in(daemon.home, "status").stdout.split())
    assert f"MTP depth {health['depth']} (fused loop), 4bit{DEQUANTIZED_LABEL}" in shown
    held = human_bytes(health["model_info"]["weights_bytes"])  # the dense bytes, as the guard prices them
    assert f"(model weights {held})" in shown
