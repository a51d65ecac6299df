"""What coding agents do to a conversation, and what the bank restores for each habit.

Every warm result is compared with a cold run of the same prompt (greedy, MTP depth 3):
the bank may only change how much is prefilled, never what is generated.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mtplxd.engine.session.bank import BankSettings

CHUNK = 32  # the tests' prefill chunk: hybrid boundaries land every 32 tokens
SYSTEM = {"role": "system", "content": "You are a terse coding assistant. " * 6}
USER = {"role": "user", "content": "Write add(a, b) in Python and explain it briefly."}


def render(model, messages) -> list[int]:
    return list(model.tokenizer.apply_chat_template(messages, add_generation_prompt=True))


@pytest.fixture(params=["qwen3", "qwen3_5"])
def banked(request, loaded):
    """A tiny model of each family with a fresh bank; the bank is removed afterwards."""
    model = loaded(request.param)
    model.enable_session_bank(BankSettings())
    yield model
    model.bank = None


def cold(model, gen, prompt, **kwargs):
    bank, model.bank = model.bank, None
    try:
        return gen(model, prompt, **kwargs)
    finally:
        model.bank = bank


def test_new_user_turn_prefills_only_the_new_turn(banked, gen):
    p1 = render(banked, [SYSTEM, USER])
    r1 = gen(banked, p1)
    p2 = render(banked, [SYSTEM, USER, {"role": "assistant", "content": r1.text},
                         {"role": "user", "content": "Now write sub(a, b)."}])
    r2 = gen(banked, p2)
    assert r2.stats.cached_tokens >= len(p1) - 1
    assert r2.token_ids == cold(banked, gen, p2).token_ids


def test_tool_result_appended(banked, gen):
    p1 = render(banked, [SYSTEM, USER])
    gen(banked, p1)
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"function": {"name": "read_file", "arguments": {"path": "a.py"}}}]}
    p2 = render(banked, [SYSTEM, USER, call, {"role": "tool", "content": "def add(a, b): ..."}])
    r2 = gen(banked, p2)
    assert r2.stats.cached_tokens >= len(p1) - 1
    assert r2.token_ids == cold(banked, gen, p2).token_ids


def test_stop_and_resend_restores_all_but_the_last_token(banked, gen):
    p1 = render(banked, [SYSTEM, USER])
    gen(banked, p1, max_tokens=3)  # the user pressed stop
    again = gen(banked, p1)
    assert again.stats.cached_tokens == len(p1) - 1
    assert again.token_ids == cold(banked, gen, p1).token_ids


@pytest.mark.parametrize("echoed", [True, False])
def test_reasoning_echoed_or_dropped(banked, gen, echoed):
    answer = {"role": "assistant", "content": "def add(a, b):\n    return a + b",
              "reasoning_content": "The user wants a function that adds two numbers."}
    history = [SYSTEM, USER, answer, {"role": "user", "content": "Add type hints."}]
    committed = render(banked, history)  # what the bank saw (reasoning included)
    gen(banked, committed)
    if not echoed:
        answer = {k: v for k, v in answer.items() if k != "reasoning_content"}
    resent = render(banked, [SYSTEM, USER, answer, {"role": "user", "content": "Add type hints."},
                             {"role": "assistant", "content": "Done."},
                             {"role": "user", "content": "Thanks, now tests."}])
    diverge = int(np.nonzero(np.array(committed[:len(resent)]) != np.array(resent[:len(committed)]))[0][0]) \
        if not echoed else len(committed)
    r = gen(banked, resent)
    cached = r.stats.cached_tokens
    assert cached <= diverge
    # Dense restores at the divergence (less one token for the head's pair); hybrid at the
    # stored boundary at or below it: a prefill chunk end at most.
    assert cached >= diverge - (CHUNK if banked.info.family != "qwen3" else 1)
    assert r.token_ids == cold(banked, gen, resent).token_ids


def test_divergence_mid_prompt_restores_longest_boundary(banked, gen, toks):
    base = toks(10, 200)
    gen(banked, base)
    edited = base[:137] + toks(11, 50)
    r = gen(banked, edited)
    if banked.info.family == "qwen3":
        assert r.stats.cached_tokens == 136
    else:
        assert r.stats.cached_tokens == 128  # the chunk end below the divergence
    assert r.token_ids == cold(banked, gen, edited).token_ids


def _snapshot(entry):
    return [np.array(a.astype(mx.float32)) for a in entry.arrays()]


def test_interleaved_near_prefix_request_leaves_its_neighbour_intact(banked, gen, toks):
    a = toks(20, 150)
    ra = gen(banked, a, session_id="A")
    [entry_a] = banked.bank.entries()
    before = _snapshot(entry_a)
    tokens_a = entry_a.tokens

    b = a[:100] + toks(21, 60)  # another conversation sharing A's first 100 tokens
    rb = gen(banked, b, session_id="B")
    assert rb.stats.cached_tokens > 0
    assert rb.token_ids == cold(banked, gen, b).token_ids

    kept = [e for e in banked.bank.entries() if e.tokens == tokens_a]
    assert kept, "B's store must not replace or supersede A's entry"
    after = _snapshot(kept[0])
    assert len(after) == len(before)
    assert all(np.array_equal(x, y) for x, y in zip(before, after))

    follow = a + ra.token_ids + toks(22, 20)
    r = gen(banked, follow, session_id="A")
    assert r.stats.cached_tokens >= len(a)
    assert r.token_ids == cold(banked, gen, follow).token_ids


def test_session_id_from_headers_priority():
    from quart import Quart

    from mtplxd.api.service import session_id_from_headers

    app = Quart(__name__)
    assert session_id_from_headers() is None  # outside a request

    async def check() -> list:
        seen = []
        for headers in ({"x-session-id": "s1"},
                        {"x-session-id": "s1", "x-session-affinity": "aff"},
                        {"x-session-id": "s1", "x-mtplx-session-id": "mine", "x-session-affinity": "a"},
                        {}):
            async with app.test_request_context("/v1/chat/completions", method="POST", headers=headers):
                seen.append(session_id_from_headers())
        return seen

    import trio

    assert trio.run(check) == ["s1", "aff", "mine", None]
