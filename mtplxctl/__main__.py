"""`mtplxctl` / `python -m mtplxctl`."""

from __future__ import annotations

import sys

from mtplxctl.cli import main

if __name__ == "__main__":
    sys.exit(main())
