"""A model without MTP heads is served AR, and /health, /v1/models and the stats say so and why."""

from __future__ import annotations

import httpx
import openai
import pytest

from mtplxd.engine.fixtures.tiny import write_tiny_checkpoint
from support.api_daemon import start_api_daemon


@pytest.fixture(scope="module")
def ar_daemon(tmp_path_factory):
    checkpoint = write_tiny_checkpoint(tmp_path_factory.mktemp("ar-models") / "tiny-llama", "llama")
    daemon = start_api_daemon(tmp_path_factory.mktemp("ar-home"), MTPLX_MODEL=str(checkpoint))
    try:
        yield daemon
    finally:
        daemon.stop()


def test_health_reports_ar_mode_with_the_reason_as_a_degradation(ar_daemon):
    health = httpx.get(ar_daemon.base_url + "/health").json()
    assert health["status"] == "ok" and health["mode"] == "ar" and health["depth"] == 0
    assert health["ar_reason"]
    assert health["degradations"] == [{"what": "mtp", "why": health["ar_reason"]}]
    card = httpx.get(ar_daemon.base_url + "/v1/models").json()["data"][0]
    assert card["id"] == "tiny-llama" and card["mtplx"]["mode"] == "ar"


def test_generation_on_an_ar_model_reports_depth_zero(ar_daemon):
    with openai.OpenAI(base_url=ar_daemon.base_url + "/v1", api_key="x", max_retries=0) as client:
        reply = client.chat.completions.create(model="tiny-llama", max_tokens=8, temperature=0,
                                               messages=[{"role": "user", "content": "hi"}],
                                               extra_body={"mtp_depth": 3})
    stats = reply.model_extra["mtplx_stats"]
    assert stats["depth"] == 0 and stats["drafted"] == 0
