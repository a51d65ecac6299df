"""A daemon serving over a distributed group, driven as a user drives it: `mtplxctl start
--hosts`, status showing every rank, the OpenAI SDK, a worker killed mid-life (503 naming
the rank, /health and status say so), `mtplxctl stop` leaving no worker behind."""

from __future__ import annotations

import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from mtplxd.engine import GenerationRequest, SamplingParams, load_model
from mtplxd.engine.fixtures.tiny import write_tiny_checkpoint

from support.daemon import greedy_completion, run_ctl, single_process_text
from support.waiting import pid_gone, wait_gone


@pytest.fixture
def hosts_file(tmp_path):
    hosts = {"backend": "ring", "hosts": [{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * 2}
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps(hosts))
    return path


@pytest.mark.parametrize("parallel", ["pipeline", "tensor"])
def test_start_hosts_serves_over_two_ranks_and_a_lost_worker_is_a_503_naming_it(
        tmp_path, hosts_file, monkeypatch, parallel):
    model_path = write_tiny_checkpoint(tmp_path / "tiny4", "qwen3", num_hidden_layers=4)
    # The host file's "parallel" key chooses the mode; `mtplxctl start --hosts` reads it.
    hosts_file.write_text(json.dumps({**json.loads(hosts_file.read_text()), "parallel": parallel}))
    monkeypatch.setenv("MTPLX_GROUP_PORT", "0")  # free ports: other suites run beside this one
    monkeypatch.setenv("MTPLX_GROUP_TIMEOUT_SECONDS", "10")
    started = run_ctl("start", "--port", "0", "--model", str(model_path), "--hosts",
                      str(hosts_file), "--json", timeout=180)
    assert started.returncode == 0, started.stderr + started.stdout
    status = json.loads(started.stdout)
    daemon_pid = status["pid"]
    try:
        group = json.loads(run_ctl("status", "--json").stdout)["group"]
        assert [r["rank"] for r in group["ranks"]] == [0, 1]
        assert group["parallel"] == parallel
        assert group["ranks"][0]["layers"][0] == 0 and group["ranks"][1]["layers"][1] == 4
        if parallel == "tensor":  # every rank holds a part of every layer
            assert group["ranks"][1]["layers"] == [0, 4]
        assert group["ranks"][1]["running"] and group["link"]["hop_latency_ms"] > 0
        human = run_ctl("status").stdout
        assert f"({parallel} parallel)" in human
        assert "rank 1 127.0.0.1" in human.replace("\n", " ") or "rank 1" in human

        base = status["http"]["url"]
        prompt = "def add(a, b):"
        answer = greedy_completion(status["http"]["base_url"], "tiny4", prompt, 12)
        assert answer == single_process_text(model_path, prompt, 12)  # it answers as one process
        client = openai.OpenAI(base_url=status["http"]["base_url"], api_key="none", max_retries=0)
        single = load_model(model_path)

        # Two requests at once: two rows, each with its own caches on the worker.
        prompts = ["import json\n", "class Stack:"]
        with ThreadPoolExecutor(2) as pool:
            texts = list(pool.map(lambda p: client.completions.create(
                model="tiny4", prompt=p, max_tokens=10, temperature=0).choices[0].text, prompts))
        for prompt_text, text in zip(prompts, texts):
            alone = single.complete(GenerationRequest(
                single.tokenizer.encode(prompt_text), SamplingParams(max_tokens=10)))
            assert text == alone.text

        worker_pid = group["ranks"][1]["pid"]
        os.kill(worker_pid, 9)  # a zombie until the daemon reaps it: no wait here
        with pytest.raises(openai.APIStatusError) as failed:
            client.completions.create(model="tiny4", prompt=prompt, max_tokens=4, temperature=0)
        assert failed.value.status_code == 503
        body = failed.value.response.json()
        assert body["error"]["code"] == "group_lost"
        assert "rank 1 (127.0.0.1) exited with code -9" in body["error"]["message"]

        health = httpx.get(f"{base}/health").json()
        assert health["status"] == "group_lost" and "rank 1" in health["group"]["lost"]
        assert health["group"]["ranks"][1]["running"] is False
        lost = json.loads(run_ctl("status", "--json").stdout)["group"]["lost"]
        assert "rank 1" in lost
        assert "lost:" in run_ctl("status").stdout
    finally:
        stopped = run_ctl("stop")
    assert stopped.returncode == 0, stopped.stderr
    assert wait_gone(daemon_pid)


def test_stop_stops_every_worker(tmp_path, hosts_file, monkeypatch):
    model_path = write_tiny_checkpoint(tmp_path / "tiny4", "qwen3_5")
    monkeypatch.setenv("MTPLX_GROUP_PORT", "0")
    started = run_ctl("start", "--port", "0", "--model", str(model_path), "--hosts",
                      str(hosts_file), "--json", timeout=180)
    assert started.returncode == 0, started.stderr + started.stdout
    group = json.loads(run_ctl("status", "--json").stdout)["group"]
    worker_pid = group["ranks"][1]["pid"]
    assert not pid_gone(worker_pid)
    stopped = run_ctl("stop")
    assert stopped.returncode == 0, stopped.stderr
    assert wait_gone(json.loads(started.stdout)["pid"])
    assert wait_gone(worker_pid)


def test_a_bad_host_file_is_a_load_error_saying_what_is_wrong(tmp_path, monkeypatch):
    bad = tmp_path / "hosts.json"
    bad.write_text(json.dumps({"hosts": [{"ssh": "mac-a.local"}]}))
    model_path = write_tiny_checkpoint(tmp_path / "tiny", "qwen3")
    started = run_ctl("start", "--port", "0", "--model", str(model_path), "--hosts", str(bad),
                      "--json", timeout=120)
    try:
        assert started.returncode != 0
        text = started.stdout + started.stderr
        assert "needs \\\"ips\\\"" in text or 'needs "ips"' in text
    finally:
        run_ctl("stop")


def test_a_daemon_killed_with_sigkill_leaves_no_worker_behind(tmp_path, hosts_file, monkeypatch):
    model_path = write_tiny_checkpoint(tmp_path / "tiny4", "qwen3", num_hidden_layers=4)
    monkeypatch.setenv("MTPLX_GROUP_PORT", "0")
    started = run_ctl("start", "--port", "0", "--model", str(model_path), "--hosts",
                      str(hosts_file), "--json", timeout=180)
    assert started.returncode == 0, started.stderr + started.stdout
    daemon_pid = json.loads(started.stdout)["pid"]
    worker_pid = json.loads(run_ctl("status", "--json").stdout)["group"]["ranks"][1]["pid"]
    os.kill(daemon_pid, signal.SIGKILL)
    assert wait_gone(daemon_pid)
    assert wait_gone(worker_pid)  # the ring broke: the worker saw it and exited
