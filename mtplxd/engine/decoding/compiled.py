"""Caches of compiled functions, one entry per calling thread.

Why per thread: `mx.compile` keeps its traced graphs in a thread-local cache keyed by the
address of the Python function, and a compiled function erases its entries, when it is
dropped, only from the cache of the last thread that called it (MLX 0.32.4,
python/src/transforms.cpp `PyCompiledFun`). A function called on two threads therefore
leaves its graphs in the first thread's cache after it is gone. When a new function is
later allocated at the same address (CPython reuses a freed block at once) and called on
that thread with inputs of the same shapes and dtypes, MLX replays the dead function's
graph: wrong results, or a shape error downstream. The engine hit this in its tests (a
fused cycle replayed a dropped draft half's graph: "[concatenate] ... dimensions 3 and 1"),
where one model runs on the test thread and on an owner thread; the daemon runs MLX on its
owner thread alone, but nothing in the engine should depend on that.

So every compiled function here is built for, and only called on, one thread: its entries
always live in the cache that its erase reaches.
"""

from __future__ import annotations

import threading
from typing import Callable, Hashable


def per_thread(cache: dict[tuple, Callable], key: Hashable, build: Callable[[], Callable],
               slots: int) -> Callable:
    """`cache`'s function for `key` on the calling thread, built by `build()` on first use;
    `cache` is a small LRU of at most `slots` entries (least recently used first)."""
    entry = (threading.get_ident(), key)
    if entry in cache:
        cache[entry] = cache.pop(entry)  # most recently used last
        return cache[entry]
    while len(cache) >= slots:
        cache.pop(next(iter(cache)))
    cache[entry] = build()
    return cache[entry]
