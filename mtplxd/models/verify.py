"""Checks that a downloaded file is exactly the Hub's, and that a model folder will load.

huggingface_hub checks a plain-HTTP download's size only; the content hash is checked here: the
LFS sha256 for weights, the git blob sha1 for small files. `inspect_model` reads config.json,
the safetensors headers and the tokenizer (never the weights) and says how mtplx will serve it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from mtplxd.models.manifest import RemoteFile

_CHUNK = 8 << 20
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's content."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def git_blob_sha1(path: Path) -> str:
    """The git object id of a file's content (what the Hub reports as a non-LFS file's blob id)."""
    digest = hashlib.sha1()
    digest.update(f"blob {os.path.getsize(path)}\0".encode())
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def mismatch(path: Path, expected: RemoteFile) -> str | None:
    """Why the local file differs from the Hub's (missing, size, hash), or None when it matches."""
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    if size != expected.size:
        return f"size {size} bytes, the Hub says {expected.size}"
    if expected.sha256:
        actual = file_sha256(path)
        if actual != expected.sha256:
            return f"sha256 {actual[:12]}…, the Hub says {expected.sha256[:12]}…"
    elif expected.blob_id:
        actual = git_blob_sha1(path)
        if actual != expected.blob_id:
            return f"git blob {actual[:12]}…, the Hub says {expected.blob_id[:12]}…"
    return None


def inspect_model(path: Path) -> dict[str, Any]:
    """How mtplx will serve the model folder at `path`, from its config, headers and tokenizer.

    Returns the engine's CheckpointReport as a dict plus `tokenizer` (the file found, or None).
    `mode` is "mtp", "ar" (with `reason`) or "refused" (with `reason` saying what to do);
    a folder without a tokenizer is refused, since the daemon could not load it.
    """
    from mtplxd.engine import ModelLoadError, inspect_checkpoint

    try:
        report = inspect_checkpoint(path).to_dict()
    except ModelLoadError as exc:
        report = {"path": str(path), "model_type": None, "family": None, "mode": "refused",
                  "reason": str(exc), "quantization": None, "has_mtp_tensors": False,
                  "weights_bytes": 0, "context_length": None}
    tokenizer = next((name for name in TOKENIZER_FILES if (path / name).is_file()), None)
    report["tokenizer"] = tokenizer
    problem = _tokenizer_problem(path, tokenizer)
    if problem and report["mode"] != "refused":
        report["mode"], report["reason"] = "refused", problem
    return report


def _tokenizer_problem(path: Path, tokenizer: str | None) -> str | None:
    if tokenizer is None:
        return (f"no tokenizer in {path} (looked for {', '.join(TOKENIZER_FILES)}); "
                "download the full model folder")
    if tokenizer == "tokenizer.json":
        from tokenizers import Tokenizer

        try:
            Tokenizer.from_file(str(path / tokenizer))
        except Exception as exc:  # the tokenizers library raises its own exception types
            return f"{path / tokenizer} does not load: {exc}"
    return None
