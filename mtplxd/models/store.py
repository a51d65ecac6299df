"""The model store: pull, list, check, update and remove Hub models, pinned to exact commits.

Layout under `$MTPLX_HOME/models/`:

    hub/models--<org>--<name>/    huggingface_hub's own cache: content-addressed blobs/, one
                                  snapshots/<sha>/ folder per pulled commit, refs/
    manifests/<org>--<name>.json  what was pulled and verified (see manifest.py)

Downloading is huggingface_hub's `hf_hub_download` (its etag, size and HTTP-range retry logic,
its locks, its atomic renames); this module decides which files, checks each one against the
Hub's recorded hash afterwards, and records the result. Blobs are shared between commits, so an
update fetches only the files whose content changed. Every function here is blocking: the
daemon runs them on worker threads.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from mtplxd.models.builtin import EMBEDDED_MODEL_ID
from mtplxd.models.hub import (ModelStoreError, hub_endpoint, hub_errors, hub_offline,
                               require_online)
from mtplxd.models.manifest import (DamagedManifest, Manifests, PulledRevision, RemoteFile,
                                    RepoManifest)
from mtplxd.models.progress import (ProgressCallback, PullCancelled, ShouldStop, file_progress,
                                    no_progress)
from mtplxd.models.spec import absolute_spec, folder_problem, looks_like_path
from mtplxd.models.verify import inspect_model, mismatch

# What a model folder needs; other files (PyTorch .bin twins, GGUF, ONNX, images, `original/`
# checkpoints, repository code) are left on the Hub.
ALLOW_PATTERNS = ("*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja",
                  "*.md", "LICENSE*", "NOTICE*")
IGNORE_PATTERNS = ("original/*", "*/original/*")
DOWNLOAD_WORKERS = 4
PULL_TIMEOUT = 30.0
CHECK_TIMEOUT = 10.0
_SHA = re.compile(r"^[0-9a-f]{40}$")


def is_commit_sha(revision: str | None) -> bool:
    """True for a full 40-hex git commit sha (immutable), False for branches, tags and None."""
    return bool(revision and _SHA.match(revision))


def parse_spec(spec: str) -> tuple[str, str | None]:
    """`org/name[@revision]` -> (repo id, revision or None); raises ModelStoreError if malformed."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if looks_like_path(spec):
        raise ModelStoreError("local_path", _not_a_repo(spec))
    repo, sep, revision = spec.strip().partition("@")
    if sep and not revision:
        raise ModelStoreError("invalid_spec", f"{spec!r}: nothing after '@'; write REPO@REVISION "
                                              "(a branch, a tag or a commit sha)")
    try:
        validate_repo_id(repo)
    except HFValidationError as exc:
        raise ModelStoreError("invalid_spec", f"{spec!r} is not a Hub repo id (org/name): {exc}") from None
    return repo, revision or None


def _not_a_repo(spec: str) -> str:
    """The store's answer to a path: a folder is served as it is, never pulled or checked."""
    folder = absolute_spec(spec)
    if Path(folder).is_dir():
        return (f"{folder} is a folder on this machine, not a Hub repo: serve it with "
                f"`mtplxctl start --model {folder}` (`mtplxctl models check {folder}` says how)")
    return folder_problem(spec)


def resolve_pulled(spec: str, models_dir: Path) -> tuple[Path, str] | None:
    """The snapshot folder and served id of a pulled model named `org/name[@revision]`, or None.

    A bare repo id serves its current revision (the last one pulled or updated); `@revision`
    picks a pulled commit by sha, sha prefix (7+ characters) or the ref it was pulled as.
    Never touches the network. Raises DamagedManifest when the repo's manifest cannot be read.
    """
    try:
        repo, revision = parse_spec(spec)
    except ModelStoreError:
        return None
    store = ModelStore(models_dir)
    manifest = store.manifests.load(repo)
    pulled = manifest.find(revision) if manifest else None
    if pulled is None:
        return None
    folder = store.snapshot_path(pulled.repo, pulled.sha)
    return (folder, pulled.repo) if folder.is_dir() else None


class ModelStore:
    """Pulled models under one models directory (see the module docstring for the layout)."""

    def __init__(self, models_dir: Path) -> None:
        self.models_dir = Path(models_dir)
        self.hub_dir = self.models_dir / "hub"
        self.manifests = Manifests(self.models_dir / "manifests")

    def repo_dir(self, repo: str) -> Path:
        return self.hub_dir / ("models--" + repo.replace("/", "--"))

    def snapshot_path(self, repo: str, sha: str) -> Path:
        """The folder the engine loads for one pulled commit."""
        return self.repo_dir(repo) / "snapshots" / sha

    # ------------------------------------------------------------------ pull

    def pull(self, spec: str, progress: ProgressCallback = no_progress,
             should_stop: ShouldStop = lambda: False) -> dict[str, Any]:
        """Download `org/name[@revision]`, verify every file and the checkpoint, record the commit.

        Files already in the store are re-verified, and any whose size or hash disagrees with
        the Hub is deleted and downloaded again (pulling again repairs a damaged model).
        Progress events go to `progress`; `should_stop()` returning True stops the download
        (PullCancelled). Returns the pulled model's description plus `downloaded` and
        `repaired` file lists. Raises ModelStoreError with a reason and what to do.
        """
        repo, ref = parse_spec(spec)
        sha, files, repo = self._resolve_remote(repo, ref, f"pull {spec}")
        with self.manifests.locked(repo):
            pulled, fetched, repaired = self._pull_resolved(repo, ref, sha, files, progress, should_stop)
        return {**describe(pulled, self.snapshot_path(repo, sha), current=True),
                "downloaded": fetched, "repaired": repaired}

    def _resolve_remote(self, repo: str, ref: str | None, action: str) -> tuple[str, list[RemoteFile], str]:
        """(commit sha, files to fetch, canonical repo id) of `repo` at `ref` on the Hub."""
        from huggingface_hub import HfApi
        from huggingface_hub.utils import filter_repo_objects

        require_online(action)
        with hub_errors(action, repo, ref):
            info = HfApi(endpoint=hub_endpoint()).model_info(
                repo, revision=ref, files_metadata=True, timeout=PULL_TIMEOUT)
        if not info.sha or not is_commit_sha(info.sha):
            raise ModelStoreError("hub_error", f"cannot {action}: {hub_endpoint()} did not report the "
                                               "commit sha of the revision, so it cannot be pinned")
        siblings = {s.rfilename: s for s in info.siblings or []}
        wanted = filter_repo_objects(sorted(siblings), allow_patterns=list(ALLOW_PATTERNS),
                                     ignore_patterns=list(IGNORE_PATTERNS))
        files = []
        for name in wanted:
            sibling = siblings[name]
            size = sibling.lfs.size if sibling.lfs else sibling.size
            if size is None:
                raise ModelStoreError("hub_error", f"cannot {action}: the Hub did not report the size "
                                                   f"of {name}, so the download cannot be verified")
            files.append(RemoteFile(path=name, size=size,
                                    sha256=sibling.lfs.sha256 if sibling.lfs else None,
                                    blob_id=sibling.blob_id))
        if not any(f.path.endswith(".safetensors") for f in files):
            raise ModelStoreError("no_weights", f"{repo}@{info.sha[:12]} has no .safetensors weights; "
                                                "mtplx serves Hugging Face-format safetensors models")
        return info.sha, files, info.id or repo

    def _pull_resolved(self, repo: str, ref: str | None, sha: str, files: list[RemoteFile],
                       progress: ProgressCallback, should_stop: ShouldStop
                       ) -> tuple[PulledRevision, list[str], list[str]]:
        """Fetch, verify, inspect and record one resolved commit (the repo lock is held)."""
        progress({"phase": "resolved", "repo": repo, "revision": sha, "requested": ref,
                  "files": len(files), "total": sum(f.size for f in files)})
        self._drop_partial_files(repo)
        fetched = self._download(repo, sha, files, progress, should_stop)
        repaired = self._verify(repo, sha, files, progress, should_stop)
        progress({"phase": "inspecting", "repo": repo, "revision": sha})
        report = inspect_model(self.snapshot_path(repo, sha))
        pulled = PulledRevision(repo=repo, sha=sha, requested=ref, files=files, report=report,
                                pulled_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))
        manifest = self._manifest_to_extend(repo)
        manifest.repo = repo
        manifest.revisions[sha] = pulled
        manifest.current = sha
        self.manifests.save(manifest)
        # `downloaded` lists every file that crossed the network, repairs included.
        return pulled, sorted(set(fetched) | set(repaired)), repaired

    def _manifest_to_extend(self, repo: str) -> RepoManifest:
        """The repo's manifest to add a revision to; a new one where it has none or where it
        is damaged (pulling again is how a damaged manifest is repaired)."""
        try:
            return self.manifests.load(repo) or RepoManifest(repo=repo)
        except DamagedManifest:
            return RepoManifest(repo=repo)

    def _drop_partial_files(self, repo: str) -> None:
        """Delete partial downloads left by a process that was killed mid-file.

        huggingface_hub writes each download to a process-unique `*.incomplete` file and removes
        it on any error it sees, but not after SIGKILL or a power cut. The repo lock is held, so
        no other mtplx pull of this repo is writing one now.
        """
        for partial in (self.repo_dir(repo) / "blobs").glob("*.incomplete"):
            partial.unlink(missing_ok=True)

    def _download(self, repo: str, sha: str, files: list[RemoteFile], progress: ProgressCallback,
                  should_stop: ShouldStop) -> list[str]:
        """hf_hub_download every file at `sha` (concurrently); returns those that hit the network."""
        failed = threading.Event()

        def stop() -> bool:
            return failed.is_set() or should_stop()

        def fetch(remote: RemoteFile) -> str | None:
            try:
                return self._fetch(repo, sha, remote, progress, stop)
            except BaseException:
                failed.set()  # the other downloads stop at their next chunk
                raise

        with ThreadPoolExecutor(max_workers=max(1, min(DOWNLOAD_WORKERS, len(files)))) as pool:
            futures = [pool.submit(fetch, remote) for remote in files]
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            # Report the cause, not a PullCancelled that our own abort produced elsewhere.
            real = [e for e in errors if not isinstance(e, PullCancelled)]
            raise (real or errors)[0]
        return [name for name in (f.result() for f in futures) if name is not None]

    def _fetch(self, repo: str, sha: str, remote: RemoteFile, progress: ProgressCallback,
               should_stop: ShouldStop) -> str | None:
        """Download one file unless the store has it; returns its path when bytes were fetched."""
        from huggingface_hub import hf_hub_download

        if should_stop():
            raise PullCancelled(f"pull stopped before {remote.path}")
        bar = file_progress(remote.path, remote.size, progress, should_stop)
        with hub_errors(f"download {remote.path} of {repo}", repo, sha):
            hf_hub_download(repo, remote.path, revision=sha, cache_dir=self.hub_dir,
                            endpoint=hub_endpoint(), tqdm_class=bar, etag_timeout=PULL_TIMEOUT)
        if bar.started.is_set():
            return remote.path
        progress({"phase": "downloading", "file": remote.path, "downloaded": remote.size,
                  "total": remote.size, "cached": True})
        return None

    def _verify(self, repo: str, sha: str, files: list[RemoteFile], progress: ProgressCallback,
                should_stop: ShouldStop) -> list[str]:
        """Check every file against the Hub's size and hash; re-download the ones that differ.

        Returns the repaired files. A file that still differs after a fresh download is removed
        and the pull fails: the store never keeps bytes the Hub does not vouch for.
        """
        repaired = []
        folder = self.snapshot_path(repo, sha)
        for index, remote in enumerate(files, 1):
            progress({"phase": "verifying", "file": remote.path, "checked": index, "files": len(files)})
            problem = mismatch(folder / remote.path, remote)
            if problem is None:
                continue
            progress({"phase": "repairing", "file": remote.path, "reason": problem})
            self._discard(repo, sha, remote)
            self._fetch(repo, sha, remote, progress, should_stop)
            problem = mismatch(folder / remote.path, remote)
            if problem is not None:
                self._discard(repo, sha, remote)
                raise ModelStoreError(
                    "integrity", f"{remote.path} of {repo}@{sha[:12]} from {hub_endpoint()} does not "
                                 f"match the Hub's record ({problem}) even after a fresh download; it "
                                 "was removed. Pull again later, or check HF_ENDPOINT if you use a mirror.")
            repaired.append(remote.path)
        return repaired

    def _discard(self, repo: str, sha: str, remote: RemoteFile) -> None:
        """Delete one file of a snapshot and the blob behind it, so the next download starts clean."""
        pointer = self.snapshot_path(repo, sha) / remote.path
        blobs = self.repo_dir(repo) / "blobs"
        targets = []
        if pointer.is_symlink():
            targets.append(pointer.resolve())
        targets += [blobs / etag for etag in (remote.sha256, remote.blob_id) if etag]
        pointer.unlink(missing_ok=True)
        for blob in targets:
            if blob.parent == blobs.resolve() or blob.parent == blobs:
                blob.unlink(missing_ok=True)

    # ------------------------------------------------------------------ list

    def list_models(self) -> list[dict[str, Any]]:
        """Every pulled revision: id, revision, size, family, serving mode and why, quantization."""
        rows = []
        readable, damaged = self.manifests.scan()
        for manifest in readable:
            for pulled in sorted(manifest.revisions.values(), key=lambda r: r.pulled_at, reverse=True):
                folder = self.snapshot_path(pulled.repo, pulled.sha)
                rows.append(describe(pulled, folder, current=pulled.sha == manifest.current))
        return rows + [self._describe_damaged(one) for one in damaged]

    def _describe_damaged(self, damaged: DamagedManifest) -> dict[str, Any]:
        """A `models.list` row for a repo whose manifest cannot be read: nothing of it is
        known but its name, its files on disk, and what to do."""
        folder = self.repo_dir(damaged.repo)
        return {
            "id": damaged.repo, "repo": damaged.repo, "revision": "", "requested": None,
            "current": True, "path": str(folder), "present": folder.is_dir(),
            "size_bytes": _disk_usage(folder), "files": 0, "pulled_at": "",
            "model_type": None, "family": None, "mode": "damaged", "damaged": True,
            "reason": (f"damaged manifest: `mtplxctl models rm {damaged.repo}`, or pull it "
                       "again"),
            "error": damaged.message, "quantization": None, "has_mtp_tensors": None,
            "context_length": None, "tokenizer": None,
        }

    # ------------------------------------------------------------------ check

    def check(self, repo: str | None = None) -> list[dict[str, Any]]:
        """Is each pulled revision still the Hub's latest for the ref it follows?

        status: "latest", "outdated" (hub_revision is newer) or "unknown" (reason says why: offline,
        unreachable, repo gone, no sha in the answer). A revision pulled by commit sha follows the
        default branch and is marked `pinned`.
        """
        if repo is not None:
            repo, _ = parse_spec(repo)
            manifest = self.manifests.load(repo)
            if manifest is None:
                raise not_pulled(repo)
            manifests = [manifest]
        else:
            manifests = self.manifests.all()
        heads: dict[tuple[str, str | None], tuple[str | None, str | None]] = {}
        rows = []
        for manifest in manifests:
            for pulled in manifest.revisions.values():
                tracking = None if is_commit_sha(pulled.requested) else pulled.requested
                key = (manifest.repo, tracking)
                if key not in heads:
                    heads[key] = self._hub_head(manifest.repo, tracking)
                hub_sha, why = heads[key]
                status = "unknown" if hub_sha is None else ("latest" if hub_sha == pulled.sha else "outdated")
                rows.append({"repo": manifest.repo, "revision": pulled.sha, "current": pulled.sha == manifest.current,
                             "tracking": tracking or "default branch", "pinned": is_commit_sha(pulled.requested),
                             "hub_revision": hub_sha, "status": status, "reason": why})
        return rows

    def _hub_head(self, repo: str, ref: str | None) -> tuple[str | None, str | None]:
        """(the Hub's commit sha for `ref`, None) or (None, why it is unknown)."""
        from huggingface_hub import HfApi

        if hub_offline():
            return None, "HF_HUB_OFFLINE is set, so the Hub was not asked"
        try:
            with hub_errors(f"check {repo}", repo, ref):
                info = HfApi(endpoint=hub_endpoint()).model_info(repo, revision=ref, timeout=CHECK_TIMEOUT)
        except ModelStoreError as exc:
            return None, exc.message
        if not is_commit_sha(info.sha):
            return None, f"{hub_endpoint()} did not report a commit sha for {repo}"
        return info.sha, None

    # ------------------------------------------------------------------ update

    def update(self, spec: str, progress: ProgressCallback = no_progress,
               should_stop: ShouldStop = lambda: False) -> dict[str, Any]:
        """Move a pulled repo to the Hub's latest commit of the ref it follows.

        Only files whose content changed are downloaded (blobs are shared between commits).
        The superseded revision is removed once the new one is verified. A repo pulled by
        commit sha moves to the default branch. Returns `updated`, `from`, `to`, `downloaded`
        and `reused`.
        """
        repo, revision = parse_spec(spec)
        if revision is not None:
            raise ModelStoreError("invalid_spec", f"update takes a repo id without @revision; to move "
                                                  f"to a given revision use `mtplxctl models pull {spec}`")
        manifest = self.manifests.load(repo)
        old = manifest.current_revision() if manifest else None
        if old is None:
            raise not_pulled(repo)
        tracking = None if is_commit_sha(old.requested) else old.requested
        sha, files, repo = self._resolve_remote(old.repo, tracking, f"update {old.repo}")
        if sha == old.sha:
            return {"updated": False, "repo": repo, "from": old.sha, "to": sha, "downloaded": [], "reused": []}
        with self.manifests.locked(repo):
            pulled, fetched, _ = self._pull_resolved(repo, tracking, sha, files, progress, should_stop)
            self._remove_revisions(repo, [old.sha])
        return {**describe(pulled, self.snapshot_path(repo, sha), current=True),
                "updated": True, "from": old.sha, "to": sha, "downloaded": fetched,
                "reused": [f.path for f in files if f.path not in fetched]}

    # ------------------------------------------------------------------ remove

    def remove(self, spec: str) -> dict[str, Any]:
        """Delete a pulled repo (every revision) or one `repo@revision`; returns what was freed.

        A repo whose manifest is damaged is removed whole (its revisions are unknown).
        """
        if spec.strip() == EMBEDDED_MODEL_ID:
            raise ModelStoreError("built_in", f"{EMBEDDED_MODEL_ID} is built into mtplx (it ships "
                                              "in the package, not in the model store), so it "
                                              "cannot be removed; `mtplxctl models list` shows "
                                              "the models that can")
        repo, revision = parse_spec(spec)
        try:
            manifest = self.manifests.load(repo)
        except DamagedManifest as damaged:
            if revision is not None:
                raise
            return self._remove_damaged(damaged)
        repo = manifest.repo if manifest else repo
        with self.manifests.locked(repo):
            if revision is None:
                if manifest is None and not self.repo_dir(repo).exists():
                    raise not_pulled(repo)
                freed = _disk_usage(self.repo_dir(repo))
                shutil.rmtree(self.repo_dir(repo), ignore_errors=True)
                self.manifests.path(repo).unlink(missing_ok=True)
                removed = sorted(manifest.revisions) if manifest else []
                return {"repo": repo, "removed": removed, "freed_bytes": freed}
            pulled = manifest.find(revision) if manifest else None
            if pulled is None:
                raise not_pulled(f"{repo}@{revision}")
            freed = self._remove_revisions(repo, [pulled.sha])
            return {"repo": repo, "removed": [pulled.sha], "freed_bytes": freed}

    def _remove_damaged(self, damaged: DamagedManifest) -> dict[str, Any]:
        """Delete a repo whose manifest cannot be read: its files and the manifest."""
        with self.manifests.locked(damaged.repo):
            folder = self.repo_dir(damaged.repo)
            freed = _disk_usage(folder)
            shutil.rmtree(folder, ignore_errors=True)
            damaged.path.unlink(missing_ok=True)
        return {"repo": damaged.repo, "removed": [], "freed_bytes": freed, "damaged": True}

    def would_delete(self, spec: str, folder: Path) -> bool:
        """True when `remove(spec)` would delete `folder` (a model folder, say the served one)."""
        folder = Path(folder).resolve()
        try:
            repo, revision = parse_spec(spec)
        except ModelStoreError:
            return False  # remove() fails on it too, deleting nothing
        try:
            manifest = self.manifests.load(repo)
        except DamagedManifest as damaged:  # removed whole, or not at all
            return revision is None and folder.is_relative_to(self.repo_dir(damaged.repo).resolve())
        repo = manifest.repo if manifest else repo
        if revision is None:
            return folder.is_relative_to(self.repo_dir(repo).resolve())
        pulled = manifest.find(revision) if manifest else None
        return pulled is not None and folder == self.snapshot_path(repo, pulled.sha).resolve()

    def _remove_revisions(self, repo: str, shas: list[str]) -> int:
        """Drop commits from the manifest and the cache (blobs still used elsewhere stay)."""
        from huggingface_hub import scan_cache_dir

        manifest = self.manifests.load(repo) or RepoManifest(repo=repo)
        for sha in shas:
            manifest.revisions.pop(sha, None)
        if manifest.current not in manifest.revisions:
            latest = max(manifest.revisions.values(), key=lambda r: r.pulled_at, default=None)
            manifest.current = latest.sha if latest else None
        self.manifests.save(manifest)
        if not manifest.revisions:
            freed = _disk_usage(self.repo_dir(repo))
            shutil.rmtree(self.repo_dir(repo), ignore_errors=True)
            return freed
        present = [sha for sha in shas if self.snapshot_path(repo, sha).is_dir()]
        if not present:
            return 0
        strategy = scan_cache_dir(self.hub_dir).delete_revisions(*present)
        strategy.execute()
        return strategy.expected_freed_size


def describe(pulled: PulledRevision, folder: Path, current: bool) -> dict[str, Any]:
    """The JSON shape of one pulled revision in `models.list`, `models.pull` and `models.update`."""
    report = pulled.report
    return {
        "id": pulled.repo,
        "repo": pulled.repo,
        "revision": pulled.sha,
        "requested": pulled.requested,
        "current": current,
        "damaged": False,
        "path": str(folder),
        "present": folder.is_dir(),
        "size_bytes": pulled.size_bytes,
        "files": len(pulled.files),
        "pulled_at": pulled.pulled_at,
        "model_type": report.get("model_type"),
        "family": report.get("family") or report.get("model_type"),
        "mode": report.get("mode"),
        "reason": report.get("reason"),
        "quantization": report.get("quantization"),
        "has_mtp_tensors": report.get("has_mtp_tensors"),
        "context_length": report.get("context_length"),
        "tokenizer": report.get("tokenizer"),
    }


def not_pulled(what: str) -> ModelStoreError:
    return ModelStoreError("not_pulled", f"{what} is not pulled; `mtplxctl models list` shows what "
                                         f"is, `mtplxctl models pull {what}` fetches it")


def _disk_usage(folder: Path) -> int:
    """Bytes of the regular files under `folder` (symlinks are not counted twice)."""
    total = 0
    for root, _dirs, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                total += os.path.getsize(path)
    return total
