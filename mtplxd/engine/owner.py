"""The model-owner thread: the one thread that touches MLX.

MLX streams and the arrays built on them belong to the thread that made them, so every load,
prefill and decode runs here. Two kinds of work reach it: jobs (`submit`: load, unload,
scoring, benchmarks), run whole in submission order, and generations (`submit_row`), which
the scheduler steps one prefill chunk or decode cycle at a time. Each loop runs one waiting
job, then one scheduler turn, so a job waits at most one turn and rows keep streaming
around it.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from typing import Callable, TypeVar

from mtplxd.engine.scheduler import Row, Scheduler

T = TypeVar("T")

_STOP = object()
_WAKE = object()  # a row was submitted: stop blocking and turn the scheduler


class ModelOwner:
    """A single worker thread with a FIFO job queue and a row scheduler in front of it."""

    def __init__(self, name: str = "mtplx-model-owner", scheduler: Scheduler | None = None) -> None:
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.scheduler = scheduler or Scheduler()
        self.scheduler.wake = lambda: self._queue.put(_WAKE)

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

    def submit_row(self, row: Row) -> Row:
        """Queue a generation for the scheduler (any thread); raises QueueFull when the
        admission queue is full. `row.cancel()` ends it at the next cycle boundary."""
        if self._thread is None:
            raise RuntimeError("ModelOwner.start() was not called")
        return self.scheduler.submit(row)

    def stop(self, timeout: float = 5.0) -> None:
        """Finish queued jobs, cancel running rows, then end the thread (waits at most
        `timeout` seconds)."""
        if self._thread is None:
            return
        self._queue.put(_STOP)
        self._thread.join(timeout)
        self._thread = None

    def _run(self) -> None:
        while True:
            try:
                # Block only when no row needs a turn.
                item = self._queue.get(block=not self.scheduler.has_work())
            except queue.Empty:
                item = None
            if item is _STOP:
                self.scheduler.drain()
                return
            if item is not None and item is not _WAKE:
                self._call(*item)
            if self.scheduler.has_work():
                self.scheduler.turn()

    @staticmethod
    def _call(fn: Callable[[], T], future: "concurrent.futures.Future[T]") -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except BaseException as exc:  # delivered to the caller, never kills the thread
            future.set_exception(exc)
