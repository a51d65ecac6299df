"""training.agent_sampling on the shipped model: Pi's hello.py prompt (1.6k tokens) greedy."""

from __future__ import annotations

import json

from training import agent_sampling


def test_the_shipped_model_calls_pis_write_tool_with_the_task(tmp_path):
    out = tmp_path / "sampling.json"
    agent_sampling.main(["--agents", "pi", "--samplers", "0:1:0", "--samples", "1",
                         "--max-tokens", "40", "--json-out", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["agent"], row["temperature"], row["samples"]) == ("pi", 0.0, 1)
    assert row["good"] == 1, row["texts"]
    assert '"name": "write"' in row["texts"][0]


def test_a_sample_does_the_task_when_it_names_the_file_and_prints_the_text():
    assert agent_sampling.does_the_task('{"path": "hello.py", "content": "print(\\"hello world\\")"}')
    assert not agent_sampling.does_the_task('{"path": "heti.py", "content": "print(\\"hello world\\")"}')
    assert not agent_sampling.does_the_task('{"path": "hello.py", "content": "print(\\"unnelige\\")"}')
    assert agent_sampling.parse_sampler("0.3:0.95:20") == (0.3, 0.95, 20)
