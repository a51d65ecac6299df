"""Logprobs of generated tokens through the real daemon and the real `openai` client: chat
(`logprobs`, `top_logprobs`) and completions (`logprobs` N, with `echo`), streamed and not,
MTP and AR alike."""

from __future__ import annotations

import openai
import pytest

MODEL_ID = "tiny-qwen3"
USER = [{"role": "user", "content": "write a function that adds two numbers"}]
GREEDY = dict(model=MODEL_ID, temperature=0, max_tokens=24)


@pytest.fixture(scope="module")
def client(api):
    with openai.OpenAI(base_url=api.base_url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def values(content) -> list[tuple[bytes, float, list[str]]]:
    return [(bytes(e.bytes), e.logprob, [t.token for t in e.top_logprobs]) for e in content]


def test_chat_logprobs_cover_every_generated_token_with_sorted_alternatives(client):
    reply = client.chat.completions.create(messages=USER, logprobs=True, top_logprobs=3, **GREEDY)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        tops = entry.top_logprobs
        assert len(tops) == 3 and [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
        assert entry.logprob <= 0 and bytes(tops[0].bytes) == bytes(entry.bytes)  # greedy: the best one
    plain = client.chat.completions.create(messages=USER, **GREEDY)
    assert plain.choices[0].logprobs is None


def test_chat_stream_sends_the_same_logprobs_as_the_whole_answer(client):
    whole = client.chat.completions.create(messages=USER, logprobs=True, top_logprobs=2, **GREEDY)
    chunks = list(client.chat.completions.create(messages=USER, logprobs=True, top_logprobs=2, stream=True,
                                                 **GREEDY))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert values(streamed) == values(whole.choices[0].logprobs.content)


def test_mtp_and_ar_report_the_same_logprobs_within_1e_4(client):
    def run(depth):
        reply = client.chat.completions.create(messages=USER, logprobs=True, top_logprobs=5,
                                               extra_body={"mtp_depth": depth}, **GREEDY)
        return reply.choices[0].logprobs.content

    ar, mtp = run(0), run(3)
    assert [bytes(e.bytes) for e in ar] == [bytes(e.bytes) for e in mtp]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(ar, mtp)) < 1e-4
    assert max(abs(x.logprob - y.logprob) for a, b in zip(ar, mtp)
               for x, y in zip(a.top_logprobs, b.top_logprobs)) < 1e-4


def test_top_logprobs_needs_logprobs_and_stays_within_20(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(messages=USER, top_logprobs=2, **GREEDY)
    assert err.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(messages=USER, logprobs=True, top_logprobs=21, **GREEDY)


def test_completion_logprobs_line_up_with_the_text(client):
    reply = client.completions.create(prompt="import json\n", logprobs=2, **GREEDY)
    lp, text = reply.choices[0].logprobs, reply.choices[0].text
    assert len(lp.tokens) == len(lp.token_logprobs) == reply.usage.completion_tokens
    assert "".join(lp.tokens) == text
    assert [text[o:o + len(t)] for o, t in zip(lp.text_offset, lp.tokens)] == lp.tokens
    assert all(len(top) <= 2 and max(top.values()) >= lp_value - 1e-6
               for top, lp_value in zip(lp.top_logprobs, lp.token_logprobs))


def test_echo_with_generation_scores_the_prompt_and_the_output_together(client):
    prompt = "def add(a, b):\n    return"
    scored = client.completions.create(prompt=prompt, echo=True, logprobs=1, model=MODEL_ID, max_tokens=0)
    reply = client.completions.create(prompt=prompt, echo=True, logprobs=1, **GREEDY)
    lp, n = reply.choices[0].logprobs, reply.usage.prompt_tokens
    assert len(lp.tokens) == n + reply.usage.completion_tokens
    assert lp.token_logprobs[0] is None
    assert lp.token_logprobs[:n] == scored.choices[0].logprobs.token_logprobs
    assert "".join(lp.tokens) == reply.choices[0].text and reply.choices[0].text.startswith(prompt)
    chunks = list(client.completions.create(prompt=prompt, echo=True, logprobs=1, stream=True, **GREEDY))
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs


def test_responses_put_the_logprobs_on_the_output_text(client):
    base = dict(model=MODEL_ID, input="write a function that adds two numbers", temperature=0,
                max_output_tokens=16, top_logprobs=2, include=["message.output_text.logprobs"])
    whole = client.responses.create(**base)
    [message] = [i for i in whole.output if i.type == "message"]
    logprobs = message.content[0].logprobs
    assert len(logprobs) == whole.usage.output_tokens
    assert all(len(e.top_logprobs) == 2 for e in logprobs)
    streamed = [e for event in client.responses.create(stream=True, **base)
                if event.type == "response.output_text.delta" for e in event.logprobs]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in logprobs]
