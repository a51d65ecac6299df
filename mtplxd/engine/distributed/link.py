"""Rank 0's end of the ring: every collective runs on one link thread, under a deadline.

MLX's send and receive have no timeout: a receive from a rank that hangs blocks its thread
for ever, and one from a rank that died raises RuntimeError ("connection to a peer was
lost"). So the owner thread never calls them itself: it hands each exchange to the link
thread and waits at most `timeout` seconds. A timeout or a broken ring marks the group lost
(the reason kept for /health and status), calls `on_lost` (the launcher stops the workers,
which also unblocks a stuck receive), and raises GroupLost; every later call raises it at
once. A worker process that ends mid-exchange does not always break the ring at once (a
collective can stay blocked on its sockets), so while it waits the owner also asks `ended`
(the launcher's view of the worker processes) ten times a second: a dead worker costs a
poll, not the deadline. The group is not rebuilt in this process (MLX joins a group once per
process): the daemon refuses work until it is restarted.

Once serving, a heartbeat thread sends a PING around the ring whenever no exchange ran for a
quarter of the deadline: workers, which exit after a deadline without word from rank 0,
stay up while the daemon is idle and leave when it hangs; and a worker lost while nobody
asks anything is noticed (and shown in /health) then, not at the next request.
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
RING_BROKE = "the ring broke"  # how a lost reason starts when a peer is gone (not hung)
EXIT_POLL_S = 0.1  # how often a waiting exchange asks whether a worker process ended


class Link:
    """Rank 0's side of the group: row ids, pending frees, exchanges with deadlines."""

    def __init__(self, timeout: float = DEFAULT_TIMEOUT_S,
                 on_lost: Callable[[str], str | None] | None = None,
                 ended: Callable[[], str | None] | None = None) -> None:
        self.timeout = timeout
        self.on_lost = on_lost
        self.ended = ended  # which worker processes ended, None while all run
        self.group: mx.distributed.Group | None = None
        self.lost: str | None = None
        self.hidden_size = 0
        self.dtype: mx.Dtype = mx.float32
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mtplx-link")
        self._rows = itertools.count(1)
        self._freed: list[int] = []
        self._lock = threading.Lock()  # RemoteCache.__del__ may run on any thread
        self._lose_lock = threading.Lock()  # the heartbeat and the owner may both lose it
        self._last_exchange = time.monotonic()
        self._beat_stop = threading.Event()
        self._beat: threading.Thread | None = None
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
        future = self._thread.submit(self._unless_lost, work)
        try:
            return self._result(future, limit)
        except GroupLost:
            raise
        except concurrent.futures.TimeoutError:
            self.lose(f"a rank did not answer within {limit:g} s")
        except RuntimeError as exc:
            self.lose(f"{RING_BROKE}: {exc}")
        finally:
            self._last_exchange = time.monotonic()
        raise GroupLost(self.lost)

    def _result(self, future: concurrent.futures.Future[T], limit: float) -> T:
        """`future`'s result within `limit` seconds; RuntimeError as soon as a worker process
        is seen to have ended (TimeoutError at the deadline, as future.result)."""
        until = time.monotonic() + limit
        while True:
            left = until - time.monotonic()
            if left <= EXIT_POLL_S or self.ended is None:
                return future.result(timeout=max(left, 0.0))
            try:
                return future.result(timeout=EXIT_POLL_S)
            except concurrent.futures.TimeoutError:
                # Asked only up to a poll before the deadline: a worker that leaves on its
                # own deadline (no word from rank 0 for as long) leaves after this one, and
                # is not the cause of a hang.
                if self.ended() is not None:
                    raise RuntimeError("a worker process ended") from None

    def _unless_lost(self, work: Callable[[], T]) -> T:
        # Work queued behind the exchange that lost the group (a heartbeat) must not touch
        # the ring: with a peer gone, MLX may block in it for ever, and so would the exit.
        if self.lost is not None:
            raise GroupLost(self.lost)
        return work()

    def lose(self, reason: str) -> None:
        """Mark the group lost (first reason wins), and let the owner of the workers act."""
        with self._lose_lock:
            if self.lost is not None:
                return
            self.lost = reason  # at once: nothing queued may start an exchange now
            if self.on_lost is not None:
                detail = self.on_lost(reason)
                if detail:
                    self.lost = f"{reason} ({detail})"

    def start_heartbeat(self, interval: float | None = None) -> None:
        """PING around the ring whenever no exchange ran for `interval` (default: a quarter
        of the deadline), until stop() or the group is lost."""
        every = self.timeout / 4 if interval is None else interval
        self._beat = threading.Thread(target=self._heartbeat, args=(every,),
                                      name="mtplx-heartbeat", daemon=True)
        self._beat.start()

    def _heartbeat(self, every: float) -> None:
        def ping() -> None:
            wire.send_header(wire.Header(wire.PING), 1, self.group)
            header = wire.recv_header(self.size - 1, self.group)
            if header.op != wire.PING:
                raise RuntimeError(f"a heartbeat came back as {wire.OPS.get(header.op, header.op)}")
        while self.lost is None:
            idle = time.monotonic() - self._last_exchange
            if self._beat_stop.wait(max(every - idle, 0.0)):
                return
            if time.monotonic() - self._last_exchange >= every:
                try:
                    self.call(ping)
                except GroupLost:
                    return

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
        group, last = self.group, self.size - 1
        header = self._forward_header(row, trims, hidden)

        def exchange() -> mx.array:
            wire.send_all([header.encode(), hidden], 1, group)
            return wire.recv(tuple(hidden.shape), hidden.dtype, last, group)
        return self._timed(exchange)

    def forward_together(self, row: int, trims: list[int], hidden: mx.array,
                         compute: Callable[[mx.array], mx.array]) -> mx.array:
        """Tensor parallel: announce a forward of `hidden` (1, T, H) for `row` (after its
        `trims`) to every worker, then run `compute(hidden)` (rank 0's sharded layers, whose
        all_sums pair with the workers') on the link thread, evaluated: a rank that hangs in
        a collective costs the deadline and the group, never the owner thread."""
        group = self.group
        header = self._forward_header(row, trims, hidden)

        def exchange() -> mx.array:
            wire.send_all([header.encode(), hidden], 1, group)
            out = compute(hidden)
            mx.eval(out)
            return out
        return self._timed(exchange)

    def _forward_header(self, row: int, trims: list[int], hidden: mx.array) -> wire.Header:
        """The FORWARD header of `hidden` for `row` (evaluated first: the link thread sends
        it); trims beyond one header's room leave first on headers of their own."""
        mx.eval(hidden)
        while len(trims) > wire.MAX_TRIMS:  # never in a cycle (one trim each); kept correct
            self._send_only(row, trims[:wire.MAX_TRIMS])
            trims = trims[wire.MAX_TRIMS:]
        return wire.Header(wire.FORWARD, row, hidden.shape[1], trims, self._take_frees())

    def _timed(self, exchange: Callable[[], mx.array]) -> mx.array:
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
        self._beat_stop.set()
        if self._beat is not None:
            self._beat.join(timeout)
        if self.group is None or self.lost is not None:
            return
        try:
            self.call(lambda: wire.send_header(wire.Header(wire.STOP), 1, self.group), timeout)
        except GroupLost:
            pass
        self.lost = "stopped"
