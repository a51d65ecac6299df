"""Rank 0's link: how long an exchange waits when a worker is gone or hangs.

The exchanges here are plain callables that block on an event, as an MLX collective blocks on
its sockets; the real ring is exercised in test_distributed_group.py.
"""

from __future__ import annotations

import threading
import time

import pytest

from mtplxd.engine.distributed.link import RING_BROKE, Link
from mtplxd.engine.interface import GroupLost


def _link(timeout: float, ended) -> tuple[Link, threading.Event, list[str]]:
    release = threading.Event()
    lost: list[str] = []

    def on_lost(reason: str) -> str:
        lost.append(reason)
        release.set()  # as the launcher's stop of the workers frees a stuck receive
        return "rank 1 (127.0.0.1) exited with code -9"
    return Link(timeout, on_lost=on_lost, ended=ended), release, lost


def test_an_exchange_blocked_on_a_worker_that_ended_fails_within_a_poll():
    gone_at = time.monotonic() + 0.3
    link, release, lost = _link(30.0, lambda: "rank 1" if time.monotonic() > gone_at else None)
    began = time.monotonic()
    with pytest.raises(GroupLost) as raised:
        link.call(release.wait)
    assert time.monotonic() - began < 5  # not the 30 s deadline
    assert lost == [f"{RING_BROKE}: a worker process ended"]
    assert "exited with code -9" in str(raised.value)
    with pytest.raises(GroupLost):  # lost for good: later calls fail at once
        link.call(lambda: 1)


def test_a_hung_exchange_with_every_worker_running_fails_at_the_deadline():
    link, release, lost = _link(0.5, lambda: None)
    began = time.monotonic()
    with pytest.raises(GroupLost):
        link.call(release.wait)
    assert 0.5 <= time.monotonic() - began
    assert lost == ["a rank did not answer within 0.5 s"]


def test_an_exchange_that_answers_is_returned_whatever_the_watch():
    link, _, lost = _link(5.0, lambda: None)
    assert link.call(lambda: 41 + 1) == 42
    assert lost == []
