"""Tuned depths: what `mtplxctl tune` measured best for a model on this machine, kept in
`MTPLX_HOME/tuning.json` and used by the daemon when the model loads with `depth = auto`.

One key function serves both sides: the daemon computes `tuning_key(info)` for the loaded
model, reports it in `daemon.status` (model.tuning_key), and `tune` saves under exactly that
string; at the next load the daemon looks up the same function's answer. A tuned depth belongs
to a model as it is served (id, quantization, compute dtype, decode loop) on one machine
(OS, architecture, CPU count, memory): change any of them and the entry no longer applies.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

import psutil

from mtplxd.atomic import write_atomic

FILE_NAME = "tuning.json"
MODEL_FIELDS = ("id", "quantization", "dtype", "decode_loop")


def machine_identity() -> str:
    """This machine as the tuning key names it."""
    memory_gib = round(psutil.virtual_memory().total / 2**30)
    return f"{platform.system()}-{platform.machine()}-{os.cpu_count()}cpu-{memory_gib}GiB"


def tuning_key(info: dict[str, Any], machine: str | None = None) -> str:
    """The key of a served model (its `ModelInfo` as a dict) on `machine` (default: this one)."""
    model = "|".join(str(info.get(name)) for name in MODEL_FIELDS)
    return f"{model}@{machine or machine_identity()}"


def tuning_file(home: Path) -> Path:
    return home / FILE_NAME


def read_tuning(home: Path) -> dict[str, Any]:
    """Every saved entry by key ({} when there is none or the file is unreadable)."""
    try:
        data = json.loads(tuning_file(home).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def tuned_depth(home: Path, key: str) -> int | None:
    """The depth saved for `key`, or None."""
    entry = read_tuning(home).get(key)
    depth = entry.get("depth") if isinstance(entry, dict) else None
    return depth if isinstance(depth, int) and not isinstance(depth, bool) and depth >= 0 else None


def save_tuned(home: Path, key: str, entry: dict[str, Any]) -> Path:
    """Save `entry` (with its `depth`) under `key`, keeping the other entries; atomic."""
    data = read_tuning(home)
    data[key] = entry
    home.mkdir(parents=True, exist_ok=True)
    path = tuning_file(home)
    write_atomic(path, (json.dumps(data, indent=2) + "\n").encode())
    return path
