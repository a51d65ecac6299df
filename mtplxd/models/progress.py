"""Per-file download progress out of huggingface_hub, as plain event dicts.

huggingface_hub reports bytes through a tqdm-like class passed as `tqdm_class`; `file_progress`
builds one such class per file that turns those calls into `{"phase": "downloading", "file",
"downloaded", "total"}` events (a few per second at most), and stops the download when the
caller asks it to (a client that went away, a daemon shutting down).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

ProgressCallback = Callable[[dict[str, Any]], None]
ShouldStop = Callable[[], bool]

# Seconds between two events of one file; the first and the last are always sent.
EVENT_INTERVAL = 0.2


class PullCancelled(Exception):
    """The caller stopped the pull; finished files stay in the store for the next pull."""


def no_progress(event: dict[str, Any]) -> None:
    """The default progress callback: drop the event."""


class _FileProgress:
    """A tqdm stand-in for one file (the attributes below are set by `file_progress`)."""

    file: str = ""
    size: int | None = None
    emit: ProgressCallback = staticmethod(no_progress)
    should_stop: ShouldStop = staticmethod(lambda: False)
    started: threading.Event

    def __init__(self, *args: Any, total: int | None = None, initial: int = 0, **kwargs: Any) -> None:
        self.started.set()  # huggingface_hub builds a bar only when it fetches bytes
        self.total = self.size if self.size is not None else total
        self.n = initial
        self._last = 0.0
        self._report(force=True)

    # tqdm protocol used by huggingface_hub's http and xet paths ---------------------------------

    def update(self, n: int | float | None = 1) -> None:
        if self.should_stop():
            raise PullCancelled(f"pull stopped while downloading {self.file}")
        self.n += int(n or 0)
        self._report()

    def update_transfer(self, n: int | float | None = 1) -> None:
        """Network bytes (xet); progress counts bytes written, so nothing to add."""

    def set_postfix_str(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set_transfer_postfix_str(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set_description(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set_description_str(self, *args: Any, **kwargs: Any) -> None:
        pass

    @property
    def format_dict(self) -> dict[str, Any]:
        return {"rate": None}

    def refresh(self, *args: Any, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        self._report(force=True)

    def __enter__(self) -> "_FileProgress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -------------------------------------------------------------------------------------------

    def _report(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < EVENT_INTERVAL and self.n != self.total:
            return
        self._last = now
        self.emit({"phase": "downloading", "file": self.file, "downloaded": self.n, "total": self.total})


def file_progress(file: str, size: int | None, emit: ProgressCallback,
                  should_stop: ShouldStop) -> type[_FileProgress]:
    """A tqdm-compatible class reporting `file`'s bytes to `emit`; `.started` is set once it is used."""
    return type("FileProgress", (_FileProgress,), {
        "file": file, "size": size, "emit": staticmethod(emit),
        "should_stop": staticmethod(should_stop), "started": threading.Event(),
    })
