"""Daemon logging: a size-rotated file under logs/, plus stderr when run in a terminal."""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys
from collections import deque
from pathlib import Path

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
MAX_BYTES = 10 * 1024 * 1024
BACKUPS = 5


class PrivateRotatingFileHandler(logging.handlers.RotatingFileHandler):
    """A rotating log whose files are 0600: logs name models, paths and clients."""

    def _open(self):  # type: ignore[no-untyped-def]
        stream = super()._open()
        os.chmod(self.baseFilename, 0o600)
        return stream


def setup_logging(log_file: Path, level: str = "info", to_stderr: bool = False) -> None:
    """Send the daemon's logs to `log_file` (0600, rotating at 10 MiB, 5 backups)."""
    log_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    root = logging.getLogger()
    root.handlers.clear()
    root.setLevel(level.upper())
    handler = PrivateRotatingFileHandler(log_file, maxBytes=MAX_BYTES, backupCount=BACKUPS)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root.addHandler(handler)
    if to_stderr:
        stream = logging.StreamHandler(sys.stderr)
        stream.setFormatter(logging.Formatter(LOG_FORMAT))
        root.addHandler(stream)
    # Per-request access lines from hypercorn are noise at info level.
    logging.getLogger("hypercorn.access").setLevel(logging.WARNING)


def printable(text: str) -> str:
    """`text` with control characters and lone surrogates escaped (`\\n`, `\\ud800`), for a log
    line built from client input: a newline in a field name must not forge a log line."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def tail(log_file: Path, lines: int) -> list[str]:
    """The last `lines` lines of `log_file` (empty when there is none)."""
    try:
        with open(log_file, "r", encoding="utf-8", errors="replace") as fh:
            return [line.rstrip("\n") for line in deque(fh, maxlen=max(lines, 0))]
    except FileNotFoundError:
        return []
