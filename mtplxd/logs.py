"""Daemon logging: a size-rotated file under logs/, plus stderr when run in a terminal."""

from __future__ import annotations

import logging
import logging.handlers
import sys
from collections import deque
from pathlib import Path

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
MAX_BYTES = 10 * 1024 * 1024
BACKUPS = 5


def setup_logging(log_file: Path, level: str = "info", to_stderr: bool = False) -> None:
    """Send the daemon's logs to `log_file` (rotating at 10 MiB, 5 backups)."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    root.handlers.clear()
    root.setLevel(level.upper())
    handler = logging.handlers.RotatingFileHandler(log_file, maxBytes=MAX_BYTES, backupCount=BACKUPS)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root.addHandler(handler)
    if to_stderr:
        stream = logging.StreamHandler(sys.stderr)
        stream.setFormatter(logging.Formatter(LOG_FORMAT))
        root.addHandler(stream)
    # Per-request access lines from hypercorn are noise at info level.
    logging.getLogger("hypercorn.access").setLevel(logging.WARNING)


def tail(log_file: Path, lines: int) -> list[str]:
    """The last `lines` lines of `log_file` (empty when there is none)."""
    try:
        with open(log_file, "r", encoding="utf-8", errors="replace") as fh:
            return [line.rstrip("\n") for line in deque(fh, maxlen=max(lines, 0))]
    except FileNotFoundError:
        return []
