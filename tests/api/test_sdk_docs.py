"""docs/api.md's SDK examples run as written against a live daemon: the official openai and
anthropic Python clients, and (where Node is installed) the JavaScript fetch example."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

API_DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"


@pytest.fixture(scope="module")
def api(tiny_checkpoint, tmp_path_factory):
    """The daemon the examples talk to: the tiny chat model plus a tiny embedder and reranker
    (the retrieval examples need them)."""
    from mtplxd.engine.fixtures.retrieval import write_tiny_embedding_checkpoint, write_tiny_reranker_checkpoint
    from support.api_daemon import start_api_daemon

    root = tmp_path_factory.mktemp("retrieval")
    daemon = start_api_daemon(
        tmp_path_factory.mktemp("api-home"),
        "--embedding-model", str(write_tiny_embedding_checkpoint(root / "tiny-embedder")),
        "--reranker-model", str(write_tiny_reranker_checkpoint(root / "tiny-reranker")),
        MTPLX_MODEL=str(tiny_checkpoint))
    try:
        yield daemon
    finally:
        daemon.stop()


def blocks(language: str) -> list[str]:
    """The ```LANGUAGE blocks of docs/api.md, in order."""
    return re.findall(rf"```{language}\n(.*?)```", API_DOC.read_text(), flags=re.S)


def run(command: list[str], api, cwd: Path) -> str:
    env = {**os.environ, "MTPLX": api.base_url}
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.parametrize("client", ["openai", "anthropic"])
def test_python_sdk_example_runs_as_written(api, tmp_path, client):
    examples = [b for b in blocks("python") if f"from {client} import" in b]
    assert len(examples) >= 2  # plain chat, and streamed tool calls
    for i, example in enumerate(examples):
        script = tmp_path / f"{client}_example_{i}.py"
        script.write_text(example)
        # A random-weight model may answer with an end token at once: the run is the check.
        assert run([sys.executable, str(script)], api, tmp_path).endswith("\n")


@pytest.mark.skipif(shutil.which("node") is None, reason="Node is not installed here")
def test_javascript_fetch_example_runs_as_written(api, tmp_path):
    [example] = blocks("js")
    (tmp_path / "hello.mjs").write_text(example)
    assert run(["node", "hello.mjs"], api, tmp_path).endswith("\n")
