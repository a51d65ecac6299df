"""Model-store fixtures: a local fake Hub on 127.0.0.1 serving a tiny real checkpoint.

tests/conftest.py sets HF_HUB_OFFLINE=1 for every test; these fixtures turn it off for the
tests that talk to the fake Hub and point HF_ENDPOINT at it. huggingface_hub reads
HF_HUB_OFFLINE once at import, so its constant is reset too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import pytest

from models.fake_hub import FakeHub
from mtplxd.engine.fixtures.tiny import write_tiny_checkpoint
from mtplxd.models.store import ModelStore

REPO = "mtplx-test/Tiny-MTP"


@pytest.fixture(scope="session")
def tiny_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """The files of a tiny qwen3 checkpoint with an MTP head, plus what a Hub repo also holds."""
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model", "qwen3", fit_mtp=False)
    files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    files["README.md"] = b"# Tiny MTP\n"
    files[".gitattributes"] = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
    files["pytorch_model.bin"] = b"\0" * 64  # a PyTorch twin: never downloaded
    return files


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tiny_files: dict[str, bytes]) -> Iterator[FakeHub]:
    """A running fake Hub with REPO committed on main; HF_ENDPOINT points at it, offline mode off."""
    import huggingface_hub.constants

    fake = FakeHub().start()
    fake.commit(REPO, tiny_files)
    monkeypatch.setenv("HF_ENDPOINT", fake.url)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    try:
        yield fake
    finally:
        fake.stop()


@pytest.fixture
def store(isolated_home: Path) -> ModelStore:
    """A store in this test's own MTPLX_HOME."""
    return ModelStore(isolated_home / "models")


def changed_config(files: dict[str, bytes], **changes) -> dict[str, bytes]:
    """`files` with config.json keys changed (a new commit that touches one small file)."""
    config = json.loads(files["config.json"])
    config.update(changes)
    return {**files, "config.json": json.dumps(config, indent=2).encode()}
