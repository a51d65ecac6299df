"""Shared fixtures for the embedded-model training tests: make `training` importable."""

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
EMBEDDED_DIR = REPO_ROOT / "mtplxd" / "models" / "embedded"

# training/ is a top-level recipe folder, not an installed package.
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
