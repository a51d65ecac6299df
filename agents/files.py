"""Reading, backing up and atomically rewriting an agent's configuration file.

Every writer goes through `write_config`: it backs the old file up next to itself, writes the
new text through a temp file and a rename (mtplxd.atomic), and keeps the file's permission
bits. A file it creates gets 0600 (agent configs often end up holding secrets). A symlinked
config (dotfile managers) is written through to its target so the link survives. Text is read
with its line breaks untranslated, so a CRLF file can be written back as CRLF.
"""

from __future__ import annotations

import os
import shutil
from datetime import datetime, timezone
from pathlib import Path

from mtplxd.atomic import write_atomic

NEW_FILE_MODE = 0o600
NEW_DIR_MODE = 0o700
BACKUP_TAG = "mtplx-backup"
CRLF = "\r\n"


def real_path(path: Path) -> Path:
    """The file a write to `path` must replace: its symlink target when it is a link."""
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def read_text(path: Path) -> str | None:
    """The file's text exactly as stored (line breaks untranslated), or None when it does not exist."""
    try:
        with path.open(encoding="utf-8", newline="") as handle:
            return handle.read()
    except FileNotFoundError:
        return None


def line_break(text: str) -> str:
    """The line break a file uses: CRLF when every line ends so, else LF.

    A file mixing the two is edited as it is (new lines get LF), so nothing of it changes.
    """
    breaks = text.count("\n")
    return CRLF if breaks and text.count(CRLF) == breaks else "\n"


def with_lf(text: str, newline: str) -> str:
    """`text` of a file whose line break is `newline`, with LF line breaks (what the editors write)."""
    return text.replace(CRLF, "\n") if newline == CRLF else text


def with_newline(text: str, newline: str) -> str:
    """Text with LF line breaks written back with the file's own `newline`."""
    return text.replace("\n", CRLF) if newline == CRLF else text


def backup(path: Path, now: datetime | None = None) -> Path:
    """Copy `path` to `<name>.mtplx-backup-<UTC stamp>` beside it (mode kept) and return it."""
    stamp = (now or datetime.now(timezone.utc)).strftime("%Y%m%dT%H%M%S%fZ")
    target = path.with_name(f"{path.name}.{BACKUP_TAG}-{stamp}")
    shutil.copy2(path, target)
    return target


def missing_dirs(path: Path) -> list[Path]:
    """The parent directories of `path` that do not exist yet, outermost first."""
    missing = []
    parent = path.parent
    while not parent.exists():
        missing.append(parent)
        parent = parent.parent
    return list(reversed(missing))


def write_config(path: Path, text: str, existed: bool) -> Path | None:
    """Replace `path` with `text` atomically; return the backup made of the old file, if any.

    An existing file is backed up first and keeps its permission bits; a new one is created
    with mode 0600 inside directories created with mode 0700.
    """
    path = real_path(path)
    for directory in missing_dirs(path):
        directory.mkdir(mode=NEW_DIR_MODE)
    saved = backup(path) if existed and path.exists() else None
    write_atomic(path, text.encode("utf-8"), mode=None if existed and path.exists() else NEW_FILE_MODE)
    return saved


def delete_config(path: Path, keep_backup: bool) -> Path | None:
    """Remove a file mtplxctl created and emptied again; return the backup kept, if any.

    `keep_backup` is for a file that still holds text of the user's (comments) worth keeping.
    """
    path = real_path(path)
    if not path.exists():
        return None
    saved = backup(path) if keep_backup else None
    path.unlink()
    return saved


def remove_empty_dirs(dirs: list[Path]) -> None:
    """Remove the directories mtplxctl created, innermost first, where they are empty."""
    for directory in sorted(dirs, key=lambda d: len(d.parts), reverse=True):
        try:
            directory.rmdir()
        except OSError:
            pass
