"""The flight recorder: one JSON line per request under `MTPLX_HOME/metrics/`.

Records are handed over with `record()`, which never waits: they go into a bounded queue that
a writer thread drains to `flight.jsonl`. A full queue (a disk slower than the traffic) or a
failing disk loses records, counted in `dropped`, never a request. The files rotate so that
all of them together stay under `max_bytes`: the live file rolls at a quarter of the cap and
three older ones are kept (`flight.1.jsonl` newest ... `flight.3.jsonl` oldest).

Stdlib only, no trio: the API layer feeds it and `mtplxctl trace` reads it back.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
from pathlib import Path
from typing import Any, Iterator

log = logging.getLogger(__name__)

FILE_NAME = "flight.jsonl"
BACKUPS = 3
QUEUE_RECORDS = 1024
SCHEMA = 1


def flight_files(metrics_dir: Path) -> list[Path]:
    """The recorder's files, oldest first (the ones that exist)."""
    names = [f"flight.{i}.jsonl" for i in range(BACKUPS, 0, -1)] + [FILE_NAME]
    return [metrics_dir / name for name in names if (metrics_dir / name).is_file()]


def read_records(metrics_dir: Path) -> Iterator[dict[str, Any]]:
    """Every record on disk, oldest first; a torn or foreign line is skipped."""
    for path in flight_files(metrics_dir):
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict):
                    yield record


class FlightRecorder:
    """Appends request records to the JSONL log from a writer thread of its own."""

    def __init__(self, metrics_dir: Path, max_bytes: int, enabled: bool = True,
                 queue_records: int = QUEUE_RECORDS) -> None:
        self.metrics_dir = metrics_dir
        self.max_bytes = max(int(max_bytes), 4096)
        self.enabled = enabled
        self.written = 0
        self.dropped = 0
        self._queue: queue.Queue = queue.Queue(maxsize=queue_records)
        self._thread: threading.Thread | None = None

    @property
    def path(self) -> Path:
        return self.metrics_dir / FILE_NAME

    def start(self) -> None:
        """Start the writer thread (nothing when the recorder is off)."""
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mtplx-flight-recorder",
                                            daemon=True)
            self._thread.start()

    def record(self, entry: dict[str, Any]) -> None:
        """Queue one record; never blocks (a full queue drops it and counts it)."""
        if not self.enabled or self._thread is None:
            return
        try:
            self._queue.put_nowait(entry)
        except queue.Full:
            self.dropped += 1

    def stop(self, timeout: float = 5.0) -> None:
        """Write what is queued (bounded by `timeout`), then end the thread."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        thread.join(timeout)

    def status(self) -> dict[str, Any]:
        """What `daemon.status` shows of the recorder."""
        return {"enabled": self.enabled, "path": str(self.path), "max_bytes": self.max_bytes,
                "written": self.written, "dropped": self.dropped}

    # -- writer thread --------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            entry = self._queue.get()
            if entry is None:
                return
            try:
                self._write(json.dumps({"v": SCHEMA, **entry}, ensure_ascii=False,
                                       separators=(",", ":"), default=str) + "\n")
                self.written += 1
            except (OSError, TypeError, ValueError) as exc:
                # A full or broken disk loses this record; generation goes on regardless.
                self.dropped += 1
                log.warning("flight recorder: record lost: %s", exc)

    def _write(self, line: str) -> None:
        data = line.encode("utf-8")
        self.metrics_dir.mkdir(parents=True, exist_ok=True)
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            size = 0
        if size and size + len(data) > self.max_bytes // (BACKUPS + 1):
            self._rotate()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    def _rotate(self) -> None:
        for i in range(BACKUPS, 0, -1):
            older = self.metrics_dir / f"flight.{i}.jsonl"
            newer = self.path if i == 1 else self.metrics_dir / f"flight.{i - 1}.jsonl"
            if newer.exists():
                os.replace(newer, older)
