"""A model served over 2 and 3 real ranks (ring backend over 127.0.0.1) gives, greedy, the
single-process output token for token, AR and MTP, dense and hybrid; a worker that dies or
hangs fails the request with the reason and the group refuses work after; a rank with another
model is refused at start with the difference named.

Every rank is a real process: rank 0 is `python -m mtplxd.engine.distributed.run`, which
starts the workers with mlx.launch's launch script (engine/distributed/launcher.py), exactly
as the daemon does.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mtplxd.engine import GenerationRequest, SamplingParams, load_model

from support.waiting import wait_for

PROMPTS = [[5, 6, 7, 8, 9], [42], list(range(20, 60))]
MAX_TOKENS = 16


def hosts_file(tmp_path: Path, ranks: int, models: dict[int, Path] | None = None,
               parallel: str = "pipeline") -> Path:
    hosts = [{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]} for _ in range(ranks)]
    for rank, model in (models or {}).items():
        hosts[rank]["model"] = str(model)
    path = tmp_path / f"hosts{ranks}.json"
    path.write_text(json.dumps({"backend": "ring", "parallel": parallel, "hosts": hosts}))
    return path


def run_group(tmp_path: Path, ranks: int, model: Path, *extra: str,
              models: dict[int, Path] | None = None, parallel: str = "pipeline",
              timeout: float = 120) -> dict:
    command = [sys.executable, "-m", "mtplxd.engine.distributed.run",
               "--hosts", str(hosts_file(tmp_path, ranks, models, parallel)), "--model", str(model),
               "--log-dir", str(tmp_path / "logs"), *extra]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    assert done.stdout.strip(), f"rank 0 printed nothing (rc {done.returncode}): {done.stderr[-2000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def single_process(model_path: Path, depths: list[int]) -> dict[tuple[int, int], list[int]]:
    model = load_model(model_path)
    out = {}
    for i, prompt in enumerate(PROMPTS):
        for depth in depths:
            request = GenerationRequest(prompt, SamplingParams(max_tokens=MAX_TOKENS), depth=depth)
            out[(i, depth)] = model.complete(request).token_ids
    return out


# Head counts and MLP width that 3 ranks divide (tensor parallel splits them).
SPLIT_BY_3 = {"num_attention_heads": 6, "num_key_value_heads": 3, "intermediate_size": 192}
HYBRID_SPLIT_BY_3 = {**SPLIT_BY_3, "linear_num_key_heads": 3, "linear_num_value_heads": 6}


@pytest.fixture(scope="module")
def checkpoints(tiny_model_factory):
    # Four layers, so three ranks each hold at least one.
    return {"qwen3": tiny_model_factory("qwen3", num_hidden_layers=4),
            "qwen3_5": tiny_model_factory("qwen3_5"),
            ("qwen3", 3): tiny_model_factory("qwen3", num_hidden_layers=4, **SPLIT_BY_3),
            ("qwen3_5", 3): tiny_model_factory("qwen3_5", **HYBRID_SPLIT_BY_3),
            # bfloat16 on disk: the CPU backend upcasts it at load (lazily) to float32.
            ("qwen3_5", "bfloat16"): tiny_model_factory("qwen3_5", torch_dtype="bfloat16"),
            "qwen3_5_moe": tiny_model_factory("qwen3_5_moe")}


def bytes_of(modules) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for m in modules if m is not None for _, v in tree_flatten(m.parameters()))


def layer_prefix(family: str) -> str:
    """Where a family's decoder layers sit in the parameter names."""
    return "language_model.model.layers" if family.startswith("qwen3_5") else "model.layers"


def test_a_quantized_checkpoint_is_dequantized_on_every_rank_as_in_one_process(tmp_path, tiny_model_factory):
    """On the Linux CPU a quantized checkpoint that fits is served dense float32 (`dequantize`
    auto): a worker holds its layers so too, and the group's greedy output is one process's."""
    model = tiny_model_factory("qwen3", num_hidden_layers=4, quantize_bits=4)
    reference = single_process(model, [0, 3])
    out = run_group(tmp_path, 2, model, "--prompts", json.dumps(PROMPTS), "--depths", "0,3",
                    "--max-tokens", str(MAX_TOKENS))
    assert "refused" not in out and "lost" not in out, out
    for result in out["results"]:
        assert result["token_ids"] == reference[(result["prompt"], result["depth"])]
    dense = load_model(model)
    assert dense.info.quantization.endswith("dequantized to float32 at load")
    worker = out["group"]["ranks"][1]
    start, end = worker["layers"]
    assert worker["weights_bytes"] == bytes_of(dense.trunk.text.model.layers[start:end])
    # `dequantize = "off"` reaches the workers: they keep their layers packed.
    packed = run_group(tmp_path, 2, model, "--dequantize", "off", "--max-tokens", "2")
    kept = load_model(model, dequantize_weights="off").trunk.text.model.layers[start:end]
    assert packed["group"]["ranks"][1]["weights_bytes"] == bytes_of(kept) < worker["weights_bytes"]


@pytest.mark.parametrize(("family", "ranks", "split"), [
    ("qwen3", 2, None), ("qwen3", 3, "2,1,1"), ("qwen3_5", 2, "1,3"), ("qwen3_5", 3, None),
])
def test_greedy_output_of_a_group_equals_the_single_process_output_ar_and_mtp(
        tmp_path, checkpoints, family, ranks, split):
    model = checkpoints[family]
    depths = [0, 1, 3]
    reference = single_process(model, depths)
    extra = ["--prompts", json.dumps(PROMPTS), "--depths", ",".join(map(str, depths)),
             "--max-tokens", str(MAX_TOKENS)] + (["--split", split] if split else [])
    out = run_group(tmp_path, ranks, model, *extra)
    assert "refused" not in out and "lost" not in out, out
    assert [r["rank"] for r in out["group"]["ranks"]] == list(range(ranks))
    layers = [tuple(r["layers"]) for r in out["group"]["ranks"]]
    assert layers[0][0] == 0 and all(a[1] == b[0] for a, b in zip(layers, layers[1:]))
    if split:
        assert [e - s for s, e in layers] == [int(n) for n in split.split(",")]
    for result in out["results"]:
        key = (result["prompt"], result["depth"])
        assert result["token_ids"] == reference[key], f"prompt {key[0]} depth {key[1]} diverged"
        # A verify of K+1 tokens is one trip around the ring: one exchange per cycle (plus the
        # prefill chunks, and the one cycle the loop runs ahead and retracts at the end).
        assert result["exchanges"] <= result["cycles"] + _prefill_chunks(PROMPTS[key[0]]) + 1
    assert all(r["forwards"] > 0 for r in out["workers"])
    # A worker holds its layers and nothing else: no embedding, final norm, lm_head, MTP head.
    text = load_model(model).trunk.text
    for rank in out["group"]["ranks"][1:]:
        start, end = rank["layers"]
        assert rank["holds"] == [layer_prefix(family)]
        assert rank["weights_bytes"] == bytes_of(text.model.layers[start:end])


def test_seeded_sampled_output_of_a_group_equals_the_single_process_output(tmp_path, checkpoints):
    # Rank 0 samples from logits that are bitwise the single process's, with the same
    # position-keyed draws: a seeded T > 0 request is the same tokens, MTP and AR, as the
    # single process's stepwise loop (a group's only loop; the fused one draws otherwise).
    sampling = {"temperature": 0.8, "top_p": 0.95, "seed": 11}
    single = load_model(checkpoints["qwen3_5"], decode_loop="stepwise")
    expected = {d: single.complete(GenerationRequest(
        PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS, **sampling), depth=d)).token_ids
        for d in (0, 3)}
    out = run_group(tmp_path, 2, checkpoints["qwen3_5"], "--prompts", json.dumps(PROMPTS[:1]),
                    "--depths", "0,3", "--max-tokens", str(MAX_TOKENS),
                    "--sampling", json.dumps(sampling))
    assert {r["depth"]: r["token_ids"] for r in out["results"]} == expected


@pytest.mark.parametrize(("family", "ranks", "checkpoint"), [
    ("qwen3", 2, "qwen3"), ("qwen3", 3, ("qwen3", 3)), ("qwen3_5", 2, "qwen3_5"),
    ("qwen3_5", 3, ("qwen3_5", 3)), ("qwen3_5", 2, ("qwen3_5", "bfloat16")),
    ("qwen3_5_moe", 2, "qwen3_5_moe"),
], ids=["qwen3-2", "qwen3-3", "qwen3_5-2", "qwen3_5-3", "qwen3_5-2-bfloat16", "qwen3_5_moe-2"])
def test_greedy_output_of_a_tensor_group_equals_the_single_process_output_ar_and_mtp(
        tmp_path, checkpoints, family, ranks, checkpoint):
    model = checkpoints[checkpoint]
    depths = [0, 1, 3]
    reference = single_process(model, depths)
    out = run_group(tmp_path, ranks, model, "--prompts", json.dumps(PROMPTS), "--depths",
                    ",".join(map(str, depths)), "--max-tokens", str(MAX_TOKENS), "--logits",
                    parallel="tensor")
    assert "refused" not in out and "lost" not in out, out
    assert out["group"]["parallel"] == "tensor"
    assert [r["layers"] for r in out["group"]["ranks"]] == [[0, 4]] * ranks
    for result in out["results"]:
        key = (result["prompt"], result["depth"])
        assert result["token_ids"] == reference[key], f"prompt {key[0]} depth {key[1]} diverged"
        # A verify of K+1 tokens is one announced forward (one all_sum round per layer).
        assert result["exchanges"] <= result["cycles"] + _prefill_chunks(PROMPTS[key[0]]) + 1
    assert all(r["forwards"] > 0 for r in out["workers"])
    # Every rank holds 1/ranks of every layer; rank 0 also the embedding, final norm, lm_head
    # and MTP head, which the workers never read.
    single = load_model(model)
    text = single.trunk.text
    ends = bytes_of([text.model.embed_tokens, text.model.norm, getattr(text, "lm_head", None),
                     single.head])
    rank0, *workers = out["group"]["ranks"]
    for rank in workers:
        assert rank["holds"] == [layer_prefix(family)]
        assert rank["weights_bytes"] == rank0["weights_bytes"] - ends
    # all_sum adds the parts in another order than one matmul: equal to rounding, not bitwise
    # (the largest difference seen is in docs/distributed.md).
    worst = max(_largest_difference(single.trunk.prefill(prompt, single.trunk.make_cache())[1],
                                    logits) for prompt, logits in zip(PROMPTS, out["logits"]))
    print(f"largest logit difference, {family} tensor group of {ranks} vs one process: {worst:.3g}")
    assert worst < 1e-4


def _largest_difference(expected, got: list[float]) -> float:
    import mlx.core as mx

    return mx.abs(expected.astype(mx.float32) - mx.array(got)).max().item()


def test_a_tensor_group_refuses_a_family_without_a_tested_shard_naming_the_reason(
        tmp_path, tiny_model_factory):
    out = run_group(tmp_path, 2, tiny_model_factory("qwen3_next"), "--depths", "0",
                    parallel="tensor")
    assert ("tensor parallel serving covers qwen3, qwen3_5, qwen3_5_moe only, not qwen3_next"
            in out["refused"])
    assert '"parallel": "pipeline"' in out["refused"]


def test_a_tensor_group_refuses_gated_deltanet_heads_the_ranks_do_not_divide(
        tmp_path, tiny_model_factory):
    model = tiny_model_factory("qwen3_5", **SPLIT_BY_3)  # 2 linear key heads over 3 ranks
    out = run_group(tmp_path, 3, model, "--depths", "0", parallel="tensor")
    assert "splits linear_num_key_heads (2)" in out["refused"]
    assert "not a multiple of 3" in out["refused"]


def test_a_worker_killed_mid_generation_fails_a_tensor_request_with_group_lost(
        tmp_path, checkpoints):
    out = run_group(tmp_path, 2, checkpoints["qwen3"], "--prompts", json.dumps(PROMPTS[:1]),
                    "--depths", "3", "--max-tokens", "2000", "--fault", "kill:1:0.5",
                    "--sampling", json.dumps({"ignore_eos": True}), "--timeout", "20",
                    parallel="tensor")
    assert len(out["results"][0]["token_ids"]) == 2000  # so the kill lands mid-generation
    assert out["results"][0]["decode_tokens_per_second"] < 2000 / 0.5
    failed = out["after_fault"][0]
    assert failed["error"] == "group_lost", failed
    assert "rank 1 (127.0.0.1) exited with code -9" in failed["message"]
    # A collective with a dead peer can stay blocked on its sockets: the link's watch of the
    # worker processes ends the wait (0.5 s here), not the 20 s deadline (once seen in CI).
    assert out["after_fault_seconds"] < 10
    assert out["again"][0]["error"] == "group_lost"


def test_a_hung_worker_fails_a_tensor_request_at_the_deadline(tmp_path, checkpoints):
    # A SIGSTOPped rank leaves rank 0's all_sum waiting (its sockets stay open): the link's
    # deadline around the forward marks the group lost, and the workers are stopped.
    out = run_group(tmp_path, 2, checkpoints["qwen3"], "--prompts", json.dumps(PROMPTS[:1]),
                    "--depths", "0", "--max-tokens", "4", "--fault", "stop:1", "--timeout", "3",
                    parallel="tensor")
    failed = out["after_fault"][0]
    assert failed["error"] == "group_lost"
    assert "did not answer within 3 s" in failed["message"]
    assert 3 <= out["after_fault_seconds"] < 15
    assert not any(rank["running"] for rank in out["status"]["ranks"][1:])


def _prefill_chunks(prompt: list[int]) -> int:
    from mtplxd.engine.model.trunk import PREFILL_CHUNK

    return -(-len(prompt) // PREFILL_CHUNK)


def test_a_worker_killed_between_requests_fails_the_next_one_naming_the_rank(tmp_path, checkpoints):
    out = run_group(tmp_path, 2, checkpoints["qwen3"], "--prompts", json.dumps(PROMPTS[:1]),
                    "--depths", "3", "--max-tokens", "8", "--fault", "kill:1", "--timeout", "20")
    assert out["results"][0]["token_ids"]
    failed = out["after_fault"][0]
    assert failed["error"] == "group_lost"
    assert "rank 1 (127.0.0.1) exited with code -9" in failed["message"]
    assert out["after_fault_seconds"] < 20  # a dead peer is seen at once, not at the deadline
    assert out["status"]["ranks"][1]["exit_code"] == -9
    again = out["again"][0]
    assert again["error"] == "group_lost" and again["message"] == failed["message"]


def test_a_hung_worker_fails_the_request_at_the_deadline_and_is_stopped(tmp_path, checkpoints):
    # The deadline covers the load and the requests before the fault too: 3 s lost the group
    # before the fault on CI's loaded cores once (2026-12-07), so 6.
    out = run_group(tmp_path, 3, checkpoints["qwen3"], "--prompts", json.dumps(PROMPTS[:1]),
                    "--depths", "0", "--max-tokens", "4", "--fault", "stop:2", "--timeout", "6")
    assert "after_fault" in out, out  # else the group was lost or refused before the fault
    failed = out["after_fault"][0]
    assert failed["error"] == "group_lost"
    assert "did not answer within 6 s" in failed["message"]
    assert "still runs" in failed["message"]
    assert 6 <= out["after_fault_seconds"] < 18
    assert out["status"]["lost"] == failed["message"]
    assert not any(rank["running"] for rank in out["status"]["ranks"][1:])  # none left behind


def test_a_rank_with_another_model_revision_is_refused_naming_the_difference(
        tmp_path, tiny_model_factory, checkpoints):
    other = tiny_model_factory("qwen3", num_hidden_layers=4, seed=7)
    out = run_group(tmp_path, 2, checkpoints["qwen3"], "--depths", "0", models={1: other})
    assert "rank 1 (" in out["refused"] and "does not serve the same model" in out["refused"]
    assert "model.safetensors differs" in out["refused"]


def test_a_rank_with_another_config_is_refused_naming_the_key(tmp_path, tiny_model_factory, checkpoints):
    other = tiny_model_factory("qwen3", num_hidden_layers=4, rms_norm_eps=1e-5)
    out = run_group(tmp_path, 2, checkpoints["qwen3"], "--depths", "0", models={1: other})
    assert "config rms_norm_eps" in out["refused"]


def test_a_vision_checkpoint_over_a_group_serves_text_only_and_says_why(tmp_path):
    from mtplxd.engine.fixtures.tiny_vision import write_tiny_vision_checkpoint

    model = write_tiny_vision_checkpoint(tmp_path / "tiny-vl")
    out = run_group(tmp_path, 2, model, "--depths", "0,3", "--max-tokens", "8",
                    "--prompts", json.dumps(PROMPTS[:1]))
    assert "refused" not in out and "lost" not in out, out
    assert out["vision"]["served"] is False
    assert "not served over a distributed group" in out["vision"]["reason"]
    reference = single_process(model, [0, 3])
    for result in out["results"]:
        assert result["token_ids"][:8] == reference[(result["prompt"], result["depth"])][:8]
    # No rank loads the vision tower: the worker holds its layers' bytes and nothing more.
    text = load_model(model).trunk.text
    worker = out["group"]["ranks"][1]
    start, end = worker["layers"]
    assert worker["weights_bytes"] == bytes_of(text.model.layers[start:end])


def _exited(pid: int) -> bool:
    """Gone, or a zombie that its frozen parent (rank 0) cannot reap."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


@pytest.mark.parametrize(("ranks", "fault", "parallel"), [
    (3, signal.SIGSTOP, "pipeline"), (2, signal.SIGKILL, "pipeline"), (2, signal.SIGSTOP, "tensor"),
])
def test_workers_exit_with_a_log_line_within_the_deadline_when_rank_0_freezes_or_dies(
        tmp_path, checkpoints, ranks, fault, parallel):
    deadline = 6.0  # heartbeats every 1.5 s: slack for a loaded two-core machine
    command = [sys.executable, "-m", "mtplxd.engine.distributed.run",
               "--hosts", str(hosts_file(tmp_path, ranks, parallel=parallel)),
               "--model", str(checkpoints["qwen3"]),
               "--log-dir", str(tmp_path / "logs"), "--depths", "0", "--max-tokens", "4",
               "--timeout", f"{deadline:g}", "--hold", "120"]
    with (tmp_path / "rank0.log").open("w") as rank0_log:
        rank0 = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=rank0_log, text=True)
    pids: list[int] = []
    try:
        ready, _, _ = select.select([rank0.stdout], [], [], 120)
        assert ready, "rank 0 never started serving"
        holding = json.loads(rank0.stdout.readline())["holding"]
        pids = [rank["pid"] for rank in holding["ranks"][1:]]
        assert len(pids) == ranks - 1
        # Idle for longer than the deadline: rank 0's heartbeat keeps every worker up.
        time.sleep(deadline * 1.5)
        assert not any(_exited(pid) for pid in pids), "a worker left an idle but live rank 0"
        os.kill(rank0.pid, fault)
        took = wait_for(lambda: all(_exited(pid) for pid in pids), deadline + 10)
        # Within the deadline plus slack for a loaded machine (the log line below says which
        # path ended each worker: the deadline, or the broken ring seen at once).
        assert took is not None, "a worker still waits for a frozen or dead rank 0"
        logs = [(tmp_path / "logs" / f"rank{rank}.log").read_text() for rank in range(1, ranks)]
        assert all("exiting" in text for text in logs), logs
        if fault == signal.SIGSTOP:
            # The first worker to reach its deadline exits; a later one may see that exit as
            # its ring breaking before its own deadline comes: either way it leaves.
            assert any(f"no message within {deadline:g} s from rank 0" in text for text in logs), logs
            assert all(f"no message within {deadline:g} s" in text or "group lost" in text
                       for text in logs), logs
        else:
            assert all("group lost" in text for text in logs), logs
    finally:
        rank0.kill()
        rank0.wait()
        rank0.stdout.close()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
