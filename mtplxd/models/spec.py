"""What a model spec names: a folder on this machine, or a Hub repo id (`org/name[@REVISION]`).

One decision for every place that takes a model: `mtplxctl start --model`, `config set model`,
`models pull|check`, restart's check, and the daemon's own load (models/resolve.py) and store
(models/store.py), so a folder that is not there is called that everywhere instead of being
read as a malformed repo id.
"""

from __future__ import annotations

import os
from pathlib import Path


def looks_like_path(spec: str) -> bool:
    """True when `spec` names a folder on this machine rather than a Hub repo id: it starts
    with `/`, `~`, `./` or `../`, has more than one path separator before any `@REVISION`
    (a repo id is org/name), or exists. The CLI, the store and every model load decide here."""
    if spec.startswith(("/", "~", "./", "../")) or spec in (".", ".."):
        return True
    if spec.partition("@")[0].count("/") > 1:  # a revision may hold slashes (refs/pr/1)
        return True
    return Path(spec).expanduser().exists()


def folder_problem(spec: str) -> str:
    """Why a path-like `spec` (see looks_like_path) names no model folder, with what to do."""
    path = Path(os.path.abspath(Path(spec).expanduser()))
    if path.exists():
        return (f"{path} is a file, not a model folder; give the folder that holds the "
                "model's config.json")
    return f"no such folder: {path}; check the path, or give a Hub repo id (org/name)"


def missing_folder(spec: str) -> str | None:
    """folder_problem for a path-like `spec` that names no folder; None for a folder or a
    repo id."""
    if looks_like_path(spec) and not Path(spec).expanduser().is_dir():
        return folder_problem(spec)
    return None


def absolute_spec(spec: str) -> str:
    """`spec` with a path made absolute (`~` expanded), so whoever reads it later (the daemon,
    config.toml at the next start) finds the same folder from any working directory; a repo id
    is returned as it is."""
    return os.path.abspath(Path(spec).expanduser()) if looks_like_path(spec) else spec
