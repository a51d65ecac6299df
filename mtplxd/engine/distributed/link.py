"""Rank 0's end of the ring: every collective runs on one link thread, under a deadline.

MLX's send and receive have no timeout: a receive from a rank that hangs blocks its thread
for ever, and one from a rank that died raises RuntimeError ("connection to a peer was
lost"). So the owner thread never calls them itself: it hands each exchange to the link
thread and waits at most `timeout` seconds. A timeout or a broken ring marks the group lost
(the reason kept for /health and status), calls `on_lost` (the launcher stops the workers,
which also unblocks a stuck receive), and raises GroupLost; every later call raises it at
once. The group is not rebuilt in this process (MLX joins a group once per process): the
daemon refuses work until it is restarted.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
import time
from typing import Any, Callable, TypeVar

import mlx.core as mx

from mtplxd.engine.distributed import wire
from mtplxd.engine.interface import GroupLost

T = TypeVar("T")
DEFAULT_TIMEOUT_S = 60.0  # one exchange (a prefill chunk through every worker) at most


class Link:
    """Rank 0's side of the group: row ids, pending frees, exchanges with deadlines."""

    def __init__(self, timeout: float = DEFAULT_TIMEOUT_S,
                 on_lost: Callable[[str], str | None] | None = None) -> None:
        self.timeout = timeout
        self.on_lost = on_lost
        self.group: mx.distributed.Group | None = None
        self.lost: str | None = None
        self.hidden_size = 0
        self.dtype: mx.Dtype = mx.float32
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mtplx-link")
        self._rows = itertools.count(1)
        self._freed: list[int] = []
        self._lock = threading.Lock()  # RemoteCache.__del__ may run on any thread
        self.exchange_seconds = 0.0
        self.exchanges = 0

    @property
    def size(self) -> int:
        """Ranks in the group (1 before it is joined)."""
        return self.group.size() if self.group is not None else 1

    def call(self, work: Callable[[], T], timeout: float | None = None) -> T:
        """Run `work` on the link thread; GroupLost when it breaks or outlives the deadline."""
        if self.lost is not None:
            raise GroupLost(self.lost)
        limit = self.timeout if timeout is None else timeout
        future = self._thread.submit(work)
        try:
            return future.result(timeout=limit)
        except concurrent.futures.TimeoutError:
            self.lose(f"a rank did not answer within {limit:g} s")
        except RuntimeError as exc:
            self.lose(f"the ring broke: {exc}")
        raise GroupLost(self.lost)

    def lose(self, reason: str) -> None:
        """Mark the group lost (first reason wins), and let the owner of the workers act."""
        if self.lost is not None:
            return
        self.lost = reason
        if self.on_lost is not None:
            detail = self.on_lost(reason)
            if detail:
                self.lost = f"{reason} ({detail})"

    def join(self, timeout: float) -> None:
        """Join the group (MLX_RANK / MLX_HOSTFILE set by the caller); waits for every rank."""
        self.group = self.call(lambda: mx.distributed.init(backend="ring", strict=True), timeout)

    def ring_json(self, message: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """Send a JSON message around the ring; the message as it comes back."""
        group, last = self.group, self.size - 1

        def exchange() -> dict[str, Any]:
            wire.send_json(message, 1, group)
            return wire.recv_json(last, group)
        return self.call(exchange, timeout)

    def new_row(self) -> int:
        """A fresh row id for a remote cache."""
        return next(self._rows)

    def release(self, row: int) -> None:
        """Forget a row's caches on the workers (sent with the next message)."""
        with self._lock:
            self._freed.append(row)

    def forward(self, row: int, trims: list[int], hidden: mx.array) -> mx.array:
        """Send `hidden` (1, T, H) through every worker for `row` (after its `trims`); the
        hidden the last worker returns, evaluated."""
        mx.eval(hidden)
        group, last = self.group, self.size - 1
        while len(trims) > wire.MAX_TRIMS:  # never in a cycle (one trim each); kept correct
            self._send_only(row, trims[:wire.MAX_TRIMS])
            trims = trims[wire.MAX_TRIMS:]
        header = wire.Header(wire.FORWARD, row, hidden.shape[1], trims, self._take_frees())

        def exchange() -> mx.array:
            wire.send_all([header.encode(), hidden], 1, group)
            return wire.recv(tuple(hidden.shape), hidden.dtype, last, group)
        began = time.perf_counter()
        out = self.call(exchange)
        self.exchange_seconds += time.perf_counter() - began
        self.exchanges += 1
        return out

    def _send_only(self, row: int, trims: list[int]) -> None:
        header = wire.Header(wire.FORWARD, row, 0, trims, self._take_frees())
        self.call(lambda: wire.send_header(header, 1, self.group))

    def _take_frees(self) -> list[int]:
        with self._lock:
            frees, self._freed = self._freed[:wire.MAX_FREES], self._freed[wire.MAX_FREES:]
        return frees

    def stop(self, timeout: float = 5.0) -> None:
        """Tell every worker to exit (best effort: a lost group has nobody to tell)."""
        if self.group is None or self.lost is not None:
            return
        try:
            self.call(lambda: wire.send_header(wire.Header(wire.STOP), 1, self.group), timeout)
        except GroupLost:
            pass
        self.lost = "stopped"
