"""A retrieval model loads in slices on the real owner thread while a real chat row decodes:
the row gets a scheduler turn between every two load jobs, the model it gives equals one
loaded whole by mlx-lm, a load that breaks midway leaves nothing resident and the row exact,
and a load never reads a weight before it has been split into steps."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
import trio

from mtplxd.engine import GenerationRequest, SamplingParams, TokenDelta
from mtplxd.engine.fixtures.retrieval import write_tiny_embedding_checkpoint
from mtplxd.engine.retrieval import (EMBEDDING, RetrievalError, RetrievalModel, RetrievalPool,
                                     RetrievalSpec, begin_retrieval_load)
from mtplxd.engine.scheduler import Row
from mtplxd.runtime import RETRIEVAL_LOAD_TRIES, Runtime
from support.rows import PROMPTS, Collector

INPUTS = [[5, 6, 7], [8, 9, 10, 11], [12]]


class LoggedPool(RetrievalPool):
    """A pool that writes each load job into the same log as the chat row's deliveries (both
    run on the owner thread, so the log's order is the order they ran in). `after_step` runs
    after a step, on the owner thread (the failure test corrupts a file there)."""

    def __init__(self, specs, log: list, after_step=lambda index: None) -> None:
        super().__init__(specs, slice_bytes=1)  # one weight array per step: many steps
        self.log, self.after_step = log, after_step

    def begin_load(self, model_id: str) -> int:
        self.log.append(("load", "begin"))
        return super().begin_load(model_id)

    def load_step(self, model_id: str, index: int) -> None:
        self.log.append(("load", f"step {index}"))
        try:
            super().load_step(model_id, index)
        except RetrievalError:
            self.log.append(("load", "failed"))
            raise
        self.after_step(index)

    def finish_load(self, model_id: str) -> RetrievalModel:
        self.log.append(("load", "finish"))
        return super().finish_load(model_id)


def chat_request(runtime: Runtime, max_tokens: int) -> GenerationRequest:
    ids = runtime.model.tokenizer.encode(PROMPTS[3])
    return GenerationRequest(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), depth=2)


def start_row(runtime: Runtime, request: GenerationRequest, log: list) -> tuple[Row, Collector]:
    sink = Collector("chat", log)
    row = Row(request, lambda stop: runtime.model.generate_steps(request, stop), sink)
    runtime.owner.submit_row(row)
    return row, sink


async def until_decoding(log: list) -> None:
    """Wait until the row has streamed a token (it is past prefill: each turn now decodes)."""
    while ("chat", "TokenDelta") not in log:
        await trio.sleep(0.005)


def turns_between_load_jobs(log: list) -> list[int]:
    """For each two consecutive load jobs, how many row deliveries came between them."""
    counts, current = [], None
    for who, _ in log:
        if who == "load":
            if current is not None:
                counts.append(current)
            current = 0
        elif current is not None:
            current += 1
    return counts


async def on_owner(runtime: Runtime, fn):
    return await trio.to_thread.run_sync(runtime.owner.submit(fn).result)


def run_with_runtime(chat_checkpoint: Path, tmp_path: Path, body) -> None:
    async def main() -> None:
        runtime = Runtime(tmp_path, 2)
        runtime.start()
        try:
            await runtime.load(str(chat_checkpoint))
            await body(runtime)
        finally:
            runtime.stop()

    trio.run(main)


@pytest.fixture
def chat_checkpoint(tiny_model_factory) -> Path:
    return tiny_model_factory("qwen3")


def test_a_chat_row_decodes_between_every_two_load_steps_and_the_model_equals_a_whole_load(
        chat_checkpoint, tmp_path):
    spec = RetrievalSpec("emb", write_tiny_embedding_checkpoint(tmp_path / "emb"), EMBEDDING)
    log: list = []

    async def body(runtime: Runtime) -> None:
        runtime.retrieval = LoggedPool([spec], log)
        row, sink = start_row(runtime, chat_request(runtime, max_tokens=3000), log)
        await until_decoding(log)
        split = await runtime.run_retrieval("emb", lambda m: m.embed(INPUTS))
        assert row.phase != "done"  # the row was still decoding when the load finished
        row.cancel()

        def load_whole() -> list[list[float]]:
            from mlx_lm.utils import load  # the one-job load this replaced

            return RetrievalModel(spec, *load(str(spec.path))).embed(INPUTS)

        whole = await on_owner(runtime, load_whole)
        assert max(abs(a - b) for x, y in zip(split, whole) for a, b in zip(x, y)) < 1e-6

    run_with_runtime(chat_checkpoint, tmp_path, body)
    load_jobs = [what for who, what in log if who == "load"]
    assert load_jobs[0] == "begin" and load_jobs[-1] == "finish" and len(load_jobs) > 10
    between = turns_between_load_jobs(log)
    assert len(between) == len(load_jobs) - 1 and min(between) >= 1, between


def test_a_load_that_breaks_midway_leaves_nothing_resident_and_the_chat_row_exact(
        chat_checkpoint, tmp_path):
    spec = RetrievalSpec("emb", write_tiny_embedding_checkpoint(tmp_path / "emb"), EMBEDDING)
    weights = spec.path / "model.safetensors"

    def corrupt_after_first_weights(index: int) -> None:
        if index == 1:  # the tokenizer and one weight slice are in; the rest of the file goes
            with open(weights, "r+b") as handle:
                handle.truncate(weights.stat().st_size // 2)

    log: list = []

    async def body(runtime: Runtime) -> None:
        pool = runtime.retrieval = LoggedPool([spec], log, corrupt_after_first_weights)
        request = chat_request(runtime, max_tokens=200)
        row, sink = start_row(runtime, request, log)
        await until_decoding(log)
        with pytest.raises(RetrievalError) as failed:
            await runtime.run_retrieval("emb", lambda m: m.embed(INPUTS))
        assert failed.value.code == "load_failed" and "emb could not be loaded" in str(failed.value)
        assert pool.resident() == [] and pool.loads == {}
        assert await on_owner(runtime, lambda: pool._loading) == {}
        while row.phase != "done":
            await trio.sleep(0.01)
        solo = await on_owner(runtime, lambda: runtime.model.complete(
            GenerationRequest(list(request.prompt_ids), request.sampling, depth=0)))
        streamed = [t for item in sink.items if isinstance(item, TokenDelta) for t in item.token_ids]
        assert streamed == sink.result.token_ids == solo.token_ids

    run_with_runtime(chat_checkpoint, tmp_path, body)
    assert ("load", "failed") in log
    failed_at = log.index(("load", "failed"))
    assert ("chat", "TokenDelta") in log[failed_at:]  # the row kept decoding after the failure


def test_a_request_cancelled_midway_through_a_load_leaves_no_half_loaded_model(chat_checkpoint, tmp_path):
    spec = RetrievalSpec("emb", write_tiny_embedding_checkpoint(tmp_path / "emb"), EMBEDDING)
    log: list = []

    async def body(runtime: Runtime) -> None:
        token, client = trio.lowlevel.current_trio_token(), trio.CancelScope()

        def client_leaves(index: int) -> None:  # on the owner thread, after the third step
            if index == 2:
                token.run_sync_soon(client.cancel)

        pool = runtime.retrieval = LoggedPool([spec], log, client_leaves)
        with client:
            await runtime.run_retrieval("emb", lambda m: m.embed(INPUTS))
        assert client.cancelled_caught
        # Owner jobs run in order: this one runs after the abandon the cancelled load queued.
        assert await on_owner(runtime, lambda: (pool._loading, pool.resident())) == ({}, [])
        again = await runtime.run_retrieval("emb", lambda m: m.embed(INPUTS))
        assert pool.loads == {"emb": 1} and len(again) == len(INPUTS)

    run_with_runtime(chat_checkpoint, tmp_path, body)
    assert log.count(("load", "begin")) == 2


def test_two_concurrent_first_requests_share_one_load(chat_checkpoint, tmp_path):
    spec = RetrievalSpec("emb", write_tiny_embedding_checkpoint(tmp_path / "emb"), EMBEDDING)
    log: list = []
    vectors: list = []

    async def body(runtime: Runtime) -> None:
        pool = runtime.retrieval = LoggedPool([spec], log)

        async def embed() -> None:
            vectors.append(await runtime.run_retrieval("emb", lambda m: m.embed(INPUTS)))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(embed)
            nursery.start_soon(embed)
        assert pool.loads == {"emb": 1}

    run_with_runtime(chat_checkpoint, tmp_path, body)
    assert log.count(("load", "begin")) == 1 and vectors[0] == vectors[1]


class EvictingPool(LoggedPool):
    """Memory pressure strikes right after each of the first `evictions` loads finishes,
    before the request's batch can run (the race `run_retrieval` retries on)."""

    def __init__(self, specs, log: list, evictions: int) -> None:
        super().__init__(specs, log)
        self.evictions = evictions

    def finish_load(self, model_id: str) -> RetrievalModel:
        model = super().finish_load(model_id)
        if self.evictions:
            self.evictions -= 1
            self.release()
        return model

    def get(self, model_id: str) -> RetrievalModel:
        raise AssertionError("the daemon must never load a retrieval model whole")


def test_a_model_evicted_before_its_batch_runs_loads_again_in_steps(chat_checkpoint, tmp_path):
    spec = RetrievalSpec("emb", write_tiny_embedding_checkpoint(tmp_path / "emb"), EMBEDDING)
    log: list = []
    vectors: list = []

    async def body(runtime: Runtime) -> None:
        pool = runtime.retrieval = EvictingPool([spec], log, evictions=1)
        vectors.append(await runtime.run_retrieval("emb", lambda m: m.embed(INPUTS)))
        assert pool.loads == {"emb": 2} and pool.resident() == ["emb"]

    run_with_runtime(chat_checkpoint, tmp_path, body)
    assert log.count(("load", "begin")) == log.count(("load", "finish")) == 2
    assert len(vectors[0]) == len(INPUTS)


def test_a_model_evicted_every_time_fails_with_the_reason(chat_checkpoint, tmp_path):
    spec = RetrievalSpec("emb", write_tiny_embedding_checkpoint(tmp_path / "emb"), EMBEDDING)
    log: list = []

    async def body(runtime: Runtime) -> None:
        runtime.retrieval = EvictingPool([spec], log, evictions=100)
        with pytest.raises(RetrievalError) as failed:
            await runtime.run_retrieval("emb", lambda m: m.embed(INPUTS))
        assert failed.value.code == "load_failed" and "memory is too tight" in str(failed.value)

    run_with_runtime(chat_checkpoint, tmp_path, body)
    assert log.count(("load", "begin")) == RETRIEVAL_LOAD_TRIES


def test_begin_builds_the_model_without_reading_a_weight(tmp_path):
    spec = RetrievalSpec("emb", write_tiny_embedding_checkpoint(tmp_path / "emb"), EMBEDDING)
    before = mx.get_active_memory()
    load = begin_retrieval_load(spec, slice_bytes=64 * 1024)
    assert mx.get_active_memory() == before  # the weights are still on disk
    assert len(load.steps) >= 3  # the tokenizer, then slices of at most about 64 KiB
    model = load.run_all()
    assert mx.get_active_memory() > before
    assert abs(sum(x * x for x in model.embed([[5, 6, 7]])[0]) - 1) < 1e-5


def test_a_checkpoint_with_its_own_python_is_refused_before_any_weight_is_read(tmp_path):
    spec = RetrievalSpec("custom", write_tiny_embedding_checkpoint(tmp_path / "custom", auto_map=True),
                         EMBEDDING)
    (spec.path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(RetrievalError) as refused:
        RetrievalPool([spec]).begin_load("custom")
    assert refused.value.code == "remote_code"
