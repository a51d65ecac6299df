"""The store's record of what was pulled: one JSON manifest per repo under `models/manifests/`.

A revision enters its repo's manifest only after every file was downloaded and checked against
the Hub's size and hash, so the manifest is the list of complete, verified snapshots. Each entry
keeps the exact commit sha, the ref the user asked for (what `check` and `update` follow), and
the Hub's size and hashes of every file (what a later pull re-verifies against).
"""

from __future__ import annotations

import fcntl
import json
import os
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

from mtplxd.atomic import write_atomic
from mtplxd.models.hub import ModelStoreError

MANIFEST_FORMAT = 1


@dataclass(frozen=True)
class RemoteFile:
    """One file of a Hub revision as the Hub describes it."""

    path: str
    size: int
    sha256: str | None = None   # LFS files (weights): the content's sha256
    blob_id: str | None = None  # git blob sha1 (of the content for non-LFS files)


@dataclass
class PulledRevision:
    """One complete, verified snapshot of a repo."""

    repo: str
    sha: str
    requested: str | None        # the ref the user asked for (None: the default branch)
    pulled_at: str
    files: list[RemoteFile]
    report: dict[str, Any] = field(default_factory=dict)  # what inspect_checkpoint said

    @property
    def size_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PulledRevision":
        files = [RemoteFile(**f) for f in data.get("files", [])]
        return cls(repo=data["repo"], sha=data["sha"], requested=data.get("requested"),
                   pulled_at=data.get("pulled_at", ""), files=files, report=data.get("report") or {})


@dataclass
class RepoManifest:
    """Every pulled revision of one repo, and which one the bare repo id serves."""

    repo: str
    current: str | None = None
    revisions: dict[str, PulledRevision] = field(default_factory=dict)

    def current_revision(self) -> PulledRevision | None:
        return self.revisions.get(self.current) if self.current else None

    def find(self, revision: str | None) -> PulledRevision | None:
        """The revision a spec names: None for current, else a sha, a sha prefix or the ref asked for."""
        if revision is None:
            return self.current_revision()
        if revision in self.revisions:
            return self.revisions[revision]
        by_ref = [r for r in self.revisions.values() if r.requested == revision]
        if by_ref:
            return max(by_ref, key=lambda r: r.pulled_at)
        if len(revision) >= 7:
            by_prefix = [r for sha, r in self.revisions.items() if sha.startswith(revision)]
            if len(by_prefix) == 1:
                return by_prefix[0]
        return None

    def to_dict(self) -> dict[str, Any]:
        return {"format": MANIFEST_FORMAT, "repo": self.repo, "current": self.current,
                "revisions": {sha: rev.to_dict() for sha, rev in self.revisions.items()}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RepoManifest":
        revisions = {sha: PulledRevision.from_dict(rev) for sha, rev in data.get("revisions", {}).items()}
        return cls(repo=data["repo"], current=data.get("current"), revisions=revisions)


def repo_slug(repo: str) -> str:
    """`org/name` -> `org--name`: a file name that maps back to one repo id."""
    return repo.replace("/", "--")


def repo_of(manifest_file: Path) -> str:
    """`org--name.json` -> `org/name` (Hub repo ids never hold `--`, so the first is the slash)."""
    return manifest_file.stem.replace("--", "/", 1)


class DamagedManifest(ModelStoreError):
    """A manifest that cannot be read (not JSON, or not a manifest's shape). A model load
    meets it as ModelLoadFailed (models/resolve.py), with this message."""

    def __init__(self, repo: str, path: Path, why: str) -> None:
        super().__init__("damaged_manifest",
                         f"the manifest of {repo} ({path}) is damaged ({why}); remove it with "
                         f"`mtplxctl models rm {repo}`, or pull it again with `mtplxctl models pull {repo}`")
        self.repo = repo
        self.path = path


class Manifests:
    """Reads and writes `models/manifests/<org>--<name>.json` (atomically) and their locks."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, repo: str) -> Path:
        return self.directory / f"{repo_slug(repo)}.json"

    def load(self, repo: str) -> RepoManifest | None:
        """The repo's manifest, or None when nothing of it was pulled.

        Hub repo ids are case-insensitive, so `qwen/x` finds the manifest of `Qwen/X`.
        Raises DamagedManifest when the file cannot be read as a manifest.
        """
        file = self._file_of(repo)
        return self._read(file) if file is not None else None

    def _file_of(self, repo: str) -> Path | None:
        exact = self.path(repo)
        if exact.is_file():
            return exact
        wanted = exact.name.lower()
        return next((file for file in self._files() if file.name.lower() == wanted), None)

    def _files(self) -> list[Path]:
        return sorted(self.directory.glob("*.json")) if self.directory.is_dir() else []

    @staticmethod
    def _read(file: Path) -> RepoManifest:
        try:
            return RepoManifest.from_dict(json.loads(file.read_text()))
        except ValueError as exc:  # not JSON (or not UTF-8)
            raise DamagedManifest(repo_of(file), file, f"not JSON: {exc}") from None
        except (KeyError, TypeError, AttributeError) as exc:
            raise DamagedManifest(repo_of(file), file,
                                  f"not a manifest: {type(exc).__name__} {exc}") from None

    def save(self, manifest: RepoManifest) -> None:
        """Write the manifest; an empty one is removed."""
        if not manifest.revisions:
            self.path(manifest.repo).unlink(missing_ok=True)
            return
        write_atomic(self.path(manifest.repo), json.dumps(manifest.to_dict(), indent=2).encode())

    def all(self) -> list[RepoManifest]:
        """Every readable manifest on disk, by repo id (`scan` gives the damaged ones too)."""
        return self.scan()[0]

    def scan(self) -> tuple[list[RepoManifest], list[DamagedManifest]]:
        """Every manifest on disk read once: the readable ones by repo id, and the ones that
        cannot be read, each as the error that says what to do (a damaged manifest hides
        one repo, never the whole list)."""
        found, damaged = [], []
        for file in self._files():
            try:
                found.append(self._read(file))
            except DamagedManifest as exc:
                damaged.append(exc)
        return sorted(found, key=lambda m: m.repo.lower()), damaged

    @contextmanager
    def locked(self, repo: str) -> Iterator[None]:
        """Hold the repo's exclusive lock: one pull, update or removal of a repo at a time."""
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.directory / f".{repo_slug(repo)}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)
