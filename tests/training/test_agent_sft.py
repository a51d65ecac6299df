"""training/agent_sft.py: the masked target loss, the held-out greedy check and the text decoder."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from training import agent_sft, evaluate
from training.agent_tasks import Example, read_split
from training.mtp_model import TinyCoder, TinyCoderArgs
from training.train import PRESETS

EMBEDDED = Path(agent_sft.__file__).resolve().parent.parent / "mtplxd" / "models" / "embedded"
WEIGHTS = (0.5, 0.25, 0.15)


def tiny_model(seed: int = 0) -> TinyCoder:
    mx.random.seed(seed)
    args = TinyCoderArgs(model_type="qwen3", rms_norm_eps=1e-6, vocab_size=64, max_position_embeddings=512,
                         tie_word_embeddings=True, rope_theta=10000.0, **PRESETS["tiny"])
    model = TinyCoder(args)
    mx.eval(model.parameters())
    return model


def example(prompt_len: int, target_len: int, seed: int = 0) -> Example:
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, 64, size=prompt_len + target_len).tolist()
    return Example("pi", "call", "train", {}, ids[:prompt_len], ids[prompt_len:-1] + [2], "")


def reference_parts(model: TinyCoder, ex: Example) -> list[float]:
    """Mean CE of the trunk on the target and of MTP step s wherever it predicts a target token,
    from the plain (unchunked) forward of prompt + target + a different padding."""
    depth = len(WEIGHTS)
    seq = mx.array([ex.prompt_ids + ex.target_ids + [7] * depth])
    p, t = len(ex.prompt_ids), len(ex.target_ids)
    n = p + t
    ce = nn.losses.cross_entropy
    h = model.hidden(seq[:, :n - 1])
    parts = [ce(model.logits_from_hidden(h[:, p - 1:p - 1 + t]), seq[:, p:p + t]).mean().item()]
    feeds = [seq[:, 1 + s:n + s] for s in range(depth)]
    for s, g in enumerate(model.mtp_chain(h, feeds)):
        anchors = slice(p - 1, p - 1 + t - 1 - s)  # anchor a predicts seq[a + 2 + s], a target token
        labels = seq[:, p + 1 + s:p + t]
        parts.append(ce(model.logits_from_hidden(g[:, anchors]), labels).mean().item())
    return parts


def test_target_loss_is_the_targets_cross_entropy_whatever_the_padding_and_chunking():
    model, ex = tiny_model(), example(45, 9)
    window = agent_sft.padded_window(ex, 16 + len(WEIGHTS) + 1, 32, 0)
    assert (window.size - 1) % 32 == 0 and window.size >= 45 + 20
    total, parts = agent_sft.target_loss(model, mx.array(window[None]), 45, 9, WEIGHTS, chunk=16, width=16)
    expected = reference_parts(model, ex)
    assert np.allclose(parts.tolist(), expected, rtol=1e-4, atol=1e-5)
    assert total.item() == pytest.approx(expected[0] + sum(w * x for w, x in zip(WEIGHTS, expected[1:])), rel=1e-4)


def test_masked_loss_of_a_drill_batch_is_each_rows_target_cross_entropy():
    model = tiny_model(2)
    drills = [example(20, 6, seed=5), example(11, 9, seed=6)]
    window, mask = agent_sft.drill_windows(drills, 40, 0)
    assert mask.sum() == 6 + 9 and (window[1, 20:] == 0).all()
    total, parts = agent_sft.masked_joint_loss(model, mx.array(window), mx.array(mask), WEIGHTS)
    # The padding rows change nothing before it: each row's parts from its own unpadded
    # forward, pooled over the tokens each part scores.
    counts = [[len(d.target_ids)] + [len(d.target_ids) - 1 - s for s in range(len(WEIGHTS))] for d in drills]
    rows = [reference_parts(model, d) for d in drills]
    pooled = [sum(r[k] * c[k] for r, c in zip(rows, counts)) / sum(c[k] for c in counts) for k in range(len(WEIGHTS) + 1)]
    assert np.allclose(parts.tolist(), pooled, rtol=1e-4, atol=1e-5)
    assert total.item() == pytest.approx(pooled[0] + sum(w * x for w, x in zip(WEIGHTS, pooled[1:])), rel=1e-4)


def test_score_example_is_greedy_decoding_checked_against_the_target():
    model, ex = tiny_model(1), example(30, 8, seed=3)
    got = agent_sft.score_example(model, ex, chunk=7, extra=5)
    greedy = evaluate.greedy_complete(model, ex.prompt_ids, len(got["generated_ids"]), set())
    assert got["generated_ids"] == greedy
    assert got["matched_tokens"] == next(i for i, (g, t) in enumerate(zip(greedy + [-1] * 9, ex.target_ids)) if g != t)
    assert not got["exact"]
    # A target that is the model's own greedy continuation is an exact match.
    own = Example("pi", "call", "train", {}, ex.prompt_ids, greedy[:4], "")
    assert agent_sft.score_example(model, own, chunk=7, extra=5)["exact"]


def test_the_same_text_in_other_token_pieces_is_a_text_match():
    """The model may write `hello.py` as two pieces where the target has one: the agent gets
    the same call, so it counts as a text match (not a token match)."""
    model, ex = tiny_model(1), example(30, 8, seed=3)
    extra = 5
    # The target keeps greedy's first token, then two pieces (ids greedy never writes, the
    # last one the end token) that spell what greedy writes next: 1 + (3 - 1) + extra tokens.
    greedy = evaluate.greedy_complete(model, ex.prompt_ids, 1 + 2 + extra, set())
    a, b = [t for t in range(60) if t not in greedy][:2]
    pieces = {a: "".join(f"<{i}>" for i in greedy[1:4]), b: "".join(f"<{i}>" for i in greedy[4:])}
    def text(ids):
        return "".join(pieces.get(i, f"<{i}>") for i in ids)
    target = [greedy[0], a, b]
    assert text(target) == text(greedy)
    respelled = Example("pi", "call", "heldout", {"name": "x.py", "prompt": "t"}, ex.prompt_ids, target, text(target))
    got = agent_sft.evaluate_agents(model, [respelled], chunk=7, extra=extra, text=text)
    assert got["by_agent"]["pi/call"]["exact_match"] == 0
    assert got["by_agent"]["pi/call"]["text_exact_match"] == 1
    wrong = Example("pi", "call", "heldout", {"name": "x.py", "prompt": "t"}, ex.prompt_ids, target, text(target) + "!")
    got = agent_sft.evaluate_agents(model, [wrong], chunk=7, extra=extra, text=text)
    assert got["by_agent"]["pi/call"]["text_exact_match"] == 0


def test_byte_level_text_decodes_the_committed_targets_as_the_tokenizer_does():
    text = agent_sft.ByteLevelText(EMBEDDED / "tokenizer.json")
    held = read_split(agent_sft.AGENT_DATA / "agent_heldout.jsonl.xz")
    for ex in held[:10]:
        assert text(ex.target_ids) == ex.target_text


def test_batches_alternate_agent_examples_and_short_windows():
    from training.train import TrainConfig
    examples = [example(40, 6, seed=i) for i in range(3)]
    arrays = {"code_train": np.arange(4000) % 60 + 3, "chat_train": np.zeros(0, dtype=np.int64)}
    cfg = TrainConfig(seq_len=16, batch=1)
    batches = agent_sft.AgentBatches(examples, arrays, 0, cfg, short_batch=2, short_per_long=1, pad_to=32, width=8)
    seen = []
    for step in range(6):
        x = batches(step)
        if step % 2:
            assert batches.current is None and x.shape == (2, 16 + 1 + 3)
        else:
            p, t = batches.current
            assert (p, t) == (40, 6) and x.shape == (1, 65)
            seen.append(tuple(x[0, :p]))
    assert len(set(seen)) == 3  # an epoch visits every example once


def test_batches_cycle_agent_example_short_windows_and_copy_drills():
    from training.train import TrainConfig
    examples = [example(40, 6, seed=i) for i in range(2)]
    drills = [example(10 + i, 4 + i, seed=10 + i) for i in range(5)]
    arrays = {"code_train": np.arange(4000) % 60 + 3, "chat_train": np.zeros(0, dtype=np.int64)}
    cfg = TrainConfig(seq_len=16, batch=1)
    batches = agent_sft.AgentBatches(examples, arrays, 0, cfg, short_batch=2, short_per_long=1, pad_to=32,
                                     width=8, drills=drills, drills_per_long=2, drill_batch=3, drill_tokens=24)
    kinds, drilled = [], []
    for step in range(8):
        x = batches(step)
        if batches.drill_mask is not None:
            kinds.append("drill")
            assert x.shape == (3, 24 + 1 + 3) and batches.current is None
            for row, count in zip(x, batches.drill_mask.sum(axis=1)):
                drilled.append(next(d for d in drills if tuple(row[:len(d.prompt_ids)]) == tuple(d.prompt_ids)))
                assert count == len(drilled[-1].target_ids)
        else:
            kinds.append("agent" if batches.current else "short")
    assert kinds == ["agent", "short", "drill", "drill"] * 2
    assert {id(d) for d in drilled[:5]} == {id(d) for d in drills}  # an epoch of drills: each once


def test_entry_fine_tunes_a_checkpoint_on_agent_examples_and_reports_both_models(tmp_path):
    from training import export
    from training.train import TrainConfig, model_args

    from .test_train_loss import write_tiny_data

    data = write_tiny_data(tmp_path / "data")
    meta = json.loads((data / "meta.json").read_text())
    init_args = model_args(TrainConfig(preset="tiny"), meta["vocab_size"])
    init = export.write_checkpoint(TinyCoder(init_args), init_args, EMBEDDED, tmp_path / "init",
                                   meta["special_ids"]["<|im_end|>"])
    out = tmp_path / "out"
    agent_sft.main(["--data", str(data), "--out", str(out), "--init", str(init), "--preset", "tiny",
                    "--agents", "pi", "--steps", "4", "--warmup", "1", "--short-batch", "2",
                    "--short-seq-len", "24", "--attn-chunk", "256", "--pad-to", "256", "--drill-batch", "2",
                    "--eval-per-agent", "1", "--quick-eval", "--cache-limit-gb", "0"])
    metrics = json.loads((out / "metrics.json").read_text())
    for key in ("eval_init", "eval_new"):
        agents = metrics[key]["agents"]
        assert {k: v["examples"] for k, v in agents["by_agent"].items()} == {"pi/call": 2, "pi/final": 2}
        assert all(np.isfinite(v["target_loss"]) for v in agents["by_agent"].values())
        assert sorted(h["kind"] for h in agents["hello_py"]) == ["call", "final"]
        assert all(isinstance(h["generated"], str) for h in agents["hello_py"])
        assert np.isfinite(metrics[key]["ppl_code_heldout"]) and metrics[key]["acceptance"]
    assert metrics["history"]["steps"] == 4 and metrics["examples"]["train"] == 120
    # Step 3 of 4 was a batch of copy drills; both models were scored on the held-out ones.
    assert metrics["examples"]["drills"] == 2000 and metrics["examples"]["heldout_drills"] == 10
    for key in ("eval_init", "eval_new"):
        assert metrics[key]["drills"]["by_agent"]["pi/drill"]["examples"] == 10
    dest = tmp_path / "installed"
    export.install(out, dest, base=init)
    assert export.load_checkpoint(dest).args.rope_theta == init_args.rope_theta


def test_evaluation_starts_with_hello_py_then_round_robin_over_agents():
    held = read_split(agent_sft.AGENT_DATA / "agent_heldout.jsonl.xz")
    order = agent_sft.evaluation_order(held)
    assert sorted(map(id, order)) == sorted(map(id, held))
    assert [(e.task["name"], e.kind) for e in order[:10]] == [("hello.py", "call")] * 5 + [("hello.py", "final")] * 5
    assert len({e.agent for e in order[10:15]}) == 5
