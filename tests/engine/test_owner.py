"""The owner thread runs submitted work FIFO, on one thread, and reports exceptions."""

import threading

import pytest

from mtplxd.engine import GenerationRequest, ModelOwner, SamplingParams, load_model


def test_owner_runs_work_in_order_on_one_thread():
    owner = ModelOwner()
    owner.start()
    seen = []
    futures = [owner.submit(lambda i=i: (seen.append(i), threading.current_thread().name)[1])
               for i in range(5)]
    names = {f.result(timeout=5) for f in futures}
    owner.stop()
    assert seen == list(range(5)) and names == {"mtplx-model-owner"}


def test_owner_delivers_exceptions_and_keeps_running():
    owner = ModelOwner()
    owner.start()
    bad = owner.submit(lambda: 1 / 0)
    good = owner.submit(lambda: 42)
    with pytest.raises(ZeroDivisionError):
        bad.result(timeout=5)
    assert good.result(timeout=5) == 42
    owner.stop()


def test_load_and_generate_on_the_owner_thread(tiny_model_factory):
    owner = ModelOwner()
    owner.start()
    model = owner.submit(lambda: load_model(tiny_model_factory("qwen3"))).result(timeout=30)
    request = GenerationRequest([1, 2, 3], SamplingParams(max_tokens=6), depth=2)
    items = owner.submit(lambda: list(model.generate(request))).result(timeout=30)
    owner.stop()
    assert items[-1].stats.depth == 2 and len(items[-1].token_ids) > 0
