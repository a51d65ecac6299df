"""Compiled functions stay on one thread (decoding/compiled.py): MLX keeps traced graphs per
thread and erases a dropped function's graphs only from the last caller's cache, so a new
function at a dead one's address can replay the dead one's graph on another thread."""

from __future__ import annotations

import gc
import threading

import mlx.core as mx

from mtplxd.engine import GenerationRequest, SamplingParams
from mtplxd.engine.decoding import sampling
from mtplxd.engine.decoding.compiled import per_thread


def _scale_by(factor: float):
    def scale(x: mx.array) -> mx.array:
        return x * factor
    return scale


def _on_other_thread(fn):
    out = {}
    worker = threading.Thread(target=lambda: out.setdefault("value", fn()))
    worker.start()
    worker.join()
    return out["value"]


def _replayed_on_this_thread(get) -> list[float]:
    """Run the hazard's sequence: `get(build)` hands out a compiled x*2 on this thread and on
    another; it is dropped; then a new x*5 allocated where x*2's function lived (CPython
    reuses a freed block; the test allocates until it does) runs here. Its result."""
    x = mx.ones((3,))
    first = _scale_by(2.0)
    address = id(first)
    assert get(lambda: mx.compile(first))(x).tolist() == [2.0] * 3
    assert _on_other_thread(lambda: get(lambda: mx.compile(first))(x).tolist()) == [2.0] * 3
    del first
    get(None)  # drop every handed-out function
    gc.collect()
    misses = []  # kept alive, so that the next allocation takes another block
    while len(misses) < 100_000:
        second = _scale_by(5.0)
        if id(second) == address:
            return mx.compile(second)(x).tolist()
        misses.append(second)
    raise AssertionError("CPython never reused the dropped function's address")


def test_mlx_replays_a_dropped_function_called_on_two_threads():
    """The hazard itself, with one compiled function shared by two threads: if this starts
    failing, MLX fixed it upstream and compiled.py can go."""
    shared: dict = {}

    def get(build):
        if build is None:
            shared.clear()
            return None
        return shared.setdefault("fn", build())

    assert _replayed_on_this_thread(get) == [2.0] * 3  # x*5 ran the dead x*2's graph


def test_per_thread_functions_are_never_replayed_for_another():
    cache: dict = {}

    def get(build):
        if build is None:
            cache.clear()
            return None
        return per_thread(cache, "scale", build, slots=4)

    assert _replayed_on_this_thread(get) == [5.0] * 3


def test_each_thread_gets_its_own_entry_and_the_lru_stays_bounded():
    cache: dict = {}
    mine = per_thread(cache, "k", object, slots=2)
    assert per_thread(cache, "k", object, slots=2) is mine  # built once per thread
    theirs = _on_other_thread(lambda: per_thread(cache, "k", object, slots=2))
    assert theirs is not mine and len(cache) == 2
    per_thread(cache, "other", object, slots=2)
    assert len(cache) == 2 and mine not in cache.values()  # the least recently used went


def test_a_model_decodes_on_two_threads_with_its_own_graphs_on_each(tiny_qwen3):
    """The engine's caches (the fused cycle's graphs on the trunk, the AR samplers) hand each
    thread its own compiled functions; both threads decode the same tokens."""
    request = dict(max_tokens=12, ignore_eos=True)
    tiny_qwen3.trunk.compiled_graphs.clear()

    def decode(depth: int, temperature: float) -> list[int]:
        sampling_params = SamplingParams(temperature=temperature, seed=7, **request)
        ids = tiny_qwen3.tokenizer.encode("def add(a, b):")
        return tiny_qwen3.complete(GenerationRequest(ids, sampling_params, depth=depth)).token_ids

    here = [decode(3, 0.0), decode(0, 0.7)]
    there = _on_other_thread(lambda: [decode(3, 0.0), decode(0, 0.7)])
    assert here == there
    threads = {thread for thread, _ in tiny_qwen3.trunk.compiled_graphs}
    assert len(threads) == 2
    assert len({thread for thread, _ in sampling._ROW_SAMPLERS}) >= 2
