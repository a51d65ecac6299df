"""What every rank must agree on before serving together, and the words for a difference.

A rank that opened another revision of the model (other weights, another config) or runs
another MLX would compute something else: rank 0 refuses the group at start and names what
differs. Weights are compared by size and a digest of each file's first and last MiB:
cheap on a 100 GB checkpoint, and a different revision differs there in practice.
"""

from __future__ import annotations

import hashlib
import json
from importlib import metadata
from pathlib import Path
from typing import Any

EDGE = 1 << 20
_HASHED_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def _edges_digest(path: Path) -> str:
    size = path.stat().st_size
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        digest.update(handle.read(EDGE))
        if size > EDGE:
            handle.seek(max(size - EDGE, EDGE))
            digest.update(handle.read(EDGE))
    return digest.hexdigest()[:16]


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "?"


def fingerprint(model_path: str | Path) -> dict[str, Any]:
    """What this rank would serve: config.json, the weight files, tokenizer files, versions."""
    path = Path(model_path).expanduser()
    if not (path / "config.json").is_file():
        return {"error": f"no config.json in {path}"}
    files = {}
    for name in sorted(p.name for p in path.glob("*.safetensors")):
        files[name] = f"{(path / name).stat().st_size}:{_edges_digest(path / name)}"
    for name in _HASHED_FILES:
        if (path / name).is_file():
            files[name] = _edges_digest(path / name)
    return {
        "config": json.loads((path / "config.json").read_text()),
        "files": files,
        "versions": {p: _version(p) for p in ("mlx", "mlx-lm", "mtplx")},
    }


def differences(reference: dict[str, Any], other: dict[str, Any]) -> list[str]:
    """Human phrases for each way `other` differs from `reference` (empty: they match)."""
    if "error" in other:
        return [other["error"]]
    out = []
    for section in ("config", "versions"):
        ref, oth = reference.get(section, {}), other.get(section, {})
        for key in sorted(set(ref) | set(oth)):
            if ref.get(key) != oth.get(key):
                out.append(f"{section} {key}: {_short(oth.get(key))} (rank 0 has {_short(ref.get(key))})")
    ref_files, oth_files = reference.get("files", {}), other.get("files", {})
    for name in sorted(set(ref_files) | set(oth_files)):
        if name not in oth_files:
            out.append(f"file {name} is missing")
        elif name not in ref_files:
            out.append(f"file {name} is extra (rank 0 has none)")
        elif ref_files[name] != oth_files[name]:
            out.append(f"file {name} differs (size:digest {oth_files[name]}, rank 0 {ref_files[name]})")
    return out


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."
