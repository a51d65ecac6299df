"""The session bank through the real daemon: agents' follow-up turns report cached tokens, and a
conversation resumed after a restart prefills only its new suffix (the SSD tier)."""

from __future__ import annotations

import openai

from support.api_daemon import start_api_daemon

SYSTEM = "You are a careful Python assistant. " + "Prefer small pure functions. " * 120


def _turn(client: openai.OpenAI, messages: list[dict], session: str):
    model = client.models.list().data[0].id
    return client.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                          temperature=0, extra_headers={"x-session-id": session})


def test_follow_up_turn_reuses_the_prefix_and_survives_a_restart(tiny_model_factory, tmp_path):
    tiny_checkpoint = tiny_model_factory("qwen3")
    home = tmp_path / "home"
    daemon = start_api_daemon(home, MTPLX_MODEL=str(tiny_checkpoint))
    try:
        client = openai.OpenAI(base_url=f"{daemon.base_url}/v1", api_key="unused")
        conversation = [{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": "Write a function that adds two numbers."}]
        first = _turn(client, conversation, "agent-1")
        assert first.usage.prompt_tokens > 512  # long enough for the disk tier
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        conversation += [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "Now make it add three numbers."}]
        second = _turn(client, conversation, "agent-1")
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached >= first.usage.prompt_tokens - 1
        bank = daemon.client.call("daemon.status")["session_bank"]
        assert bank["hits"] >= 1 and bank["entries"] >= 1
    finally:
        daemon.stop()  # a clean stop flushes the disk tier

    restarted = start_api_daemon(home, MTPLX_MODEL=str(tiny_checkpoint))
    try:
        client = openai.OpenAI(base_url=f"{restarted.base_url}/v1", api_key="unused")
        conversation += [{"role": "assistant", "content": second.choices[0].message.content},
                         {"role": "user", "content": "And subtract a fourth."}]
        third = _turn(client, conversation, "agent-1")
        resumed = third.usage.prompt_tokens_details.cached_tokens
        assert resumed >= 512
        assert third.usage.prompt_tokens - resumed < third.usage.prompt_tokens // 2
        assert restarted.client.call("daemon.status")["session_bank"]["ssd_hits"] >= 1
    finally:
        restarted.stop()


def test_a_damaged_store_is_quarantined_and_the_daemon_starts_and_serves(tiny_model_factory, tmp_path):
    import httpx

    tiny_checkpoint = tiny_model_factory("qwen3")
    home = tmp_path / "home"
    daemon = start_api_daemon(home, MTPLX_MODEL=str(tiny_checkpoint))
    conversation = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": "Write a function that adds two numbers."}]
    try:
        client = openai.OpenAI(base_url=f"{daemon.base_url}/v1", api_key="unused")
        _turn(client, conversation, "agent-1")
    finally:
        daemon.stop()
    bank_dir = home / "session-bank"
    blob = next((bank_dir / "blobs").glob("*/*.safetensors"))
    blob.write_bytes(blob.read_bytes()[:100])  # a truncated blob
    (bank_dir / "manifest.sqlite").write_bytes(b"\x00garbage" * 1000)  # and a damaged manifest

    restarted = start_api_daemon(home, MTPLX_MODEL=str(tiny_checkpoint))
    try:
        status = restarted.client.call("daemon.status")
        assert status["model"]["state"] == "loaded"
        assert "moved aside" in status["session_bank"]["note"]
        health = httpx.get(f"{restarted.base_url}/health").json()
        assert [d["what"] for d in health["degradations"]] == ["session_bank"]
        assert str(home / "session-bank.damaged") in health["degradations"][0]["why"]
        client = openai.OpenAI(base_url=f"{restarted.base_url}/v1", api_key="unused")
        answer = _turn(client, conversation, "agent-1")
        assert answer.usage.prompt_tokens_details.cached_tokens == 0  # nothing damaged is served
        assert _turn(client, conversation, "agent-1").usage.prompt_tokens_details.cached_tokens > 0
        assert "moved aside" in (home / "logs" / "mtplxd.log").read_text()
    finally:
        restarted.stop()
    assert (home / "session-bank.damaged" / "manifest.sqlite").exists()
