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
