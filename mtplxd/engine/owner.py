"""The model-owner thread: the one thread that touches MLX.

MLX streams and the arrays built on them belong to the thread that made them, so every load,
prefill and decode runs here, in submission order. Callers get a concurrent.futures.Future.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from typing import Callable, TypeVar

T = TypeVar("T")

_STOP = object()


class ModelOwner:
    """A single worker thread with a FIFO queue in front of it."""

    def __init__(self, name: str = "mtplx-model-owner") -> None:
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread (idempotent)."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()

    def submit(self, fn: Callable[[], T]) -> "concurrent.futures.Future[T]":
        """Queue `fn` to run on the owner thread; its result or exception lands in the future."""
        if self._thread is None:
            raise RuntimeError("ModelOwner.start() was not called")
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._queue.put((fn, future))
        return future

    def stop(self, timeout: float = 5.0) -> None:
        """Finish queued work, then end the thread (waits at most `timeout` seconds)."""
        if self._thread is None:
            return
        self._queue.put(_STOP)
        self._thread.join(timeout)
        self._thread = None

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            fn, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # delivered to the caller, never kills the thread
                future.set_exception(exc)
