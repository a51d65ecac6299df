"""A pulled model without a Hub: a checkpoint laid out in the store as `models pull` leaves it.

Import as `from support.pulled import fake_pull` (tests/ is on pytest's pythonpath).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from mtplxd.models.manifest import PulledRevision, RemoteFile, RepoManifest
from mtplxd.models.store import ModelStore
from mtplxd.models.verify import inspect_model

FAKE_SHA = "0123456789abcdef0123456789abcdef01234567"


def fake_pull(models_dir: Path, repo: str, checkpoint: Path, sha: str = FAKE_SHA) -> Path:
    """Put a copy of `checkpoint` in the store as the pulled `repo` at commit `sha`: the
    snapshot folder and the manifest that records it. Returns the snapshot folder."""
    store = ModelStore(models_dir)
    folder = store.snapshot_path(repo, sha)
    shutil.copytree(checkpoint, folder)
    files = [RemoteFile(path=file.name, size=file.stat().st_size)
             for file in sorted(folder.iterdir()) if file.is_file()]
    pulled = PulledRevision(repo=repo, sha=sha, requested=None, files=files,
                            pulled_at="2025-01-01T00:00:00+00:00", report=inspect_model(folder))
    store.manifests.save(RepoManifest(repo=repo, current=sha, revisions={sha: pulled}))
    return folder


def write_damaged_manifest(models_dir: Path, repo: str) -> Path:
    """A manifest of `repo` that is not JSON, beside a file of the repo in the hub cache."""
    store = ModelStore(models_dir)
    manifest = store.manifests.path(repo)
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text("{not json")
    blob = store.repo_dir(repo) / "blobs" / "weights"
    blob.parent.mkdir(parents=True)
    blob.write_bytes(b"\0" * 4096)
    return manifest
