"""The model that ships inside the package: where it is and the id it is served under."""

from __future__ import annotations

from pathlib import Path

EMBEDDED_MODEL_DIR = Path(__file__).parent / "embedded"
EMBEDDED_MODEL_ID = "mtplx-tiny-coder"


def embedded_model_available() -> bool:
    """True when the package ships the embedded demo model's weights."""
    return (EMBEDDED_MODEL_DIR / "config.json").is_file()
