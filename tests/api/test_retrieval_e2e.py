"""/v1/embeddings and /v1/rerank through the real daemon (started with --embedding-model and
--reranker-model) and the real `openai` client, on tiny random-weight retrieval models."""

from __future__ import annotations

import base64
import math
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from mtplxd.engine.fixtures.retrieval import write_tiny_embedding_checkpoint, write_tiny_reranker_checkpoint
from mtplxd.engine.fixtures.tiny import write_tiny_checkpoint
from support.api_daemon import MODEL_ID, Launch, daemon_fixture

EMBEDDER, RERANKER, CUSTOM = "tiny-embedder", "tiny-reranker", "tiny-custom-code"
TEXTS = ["the model reads a file", "hello world", "def add(a, b): return a + b"]
DOCS = ["a cache keeps the keys and values of past tokens", "bananas are yellow",
        "the KV cache grows with the context", "print hello world"]


def launch(folder: Path) -> Launch:
    """The tiny chat model, two embedders (one with bundled code) and a reranker, one resident."""
    embedder = write_tiny_embedding_checkpoint(folder / EMBEDDER)
    reranker = write_tiny_reranker_checkpoint(folder / RERANKER)
    custom = write_tiny_embedding_checkpoint(folder / CUSTOM, auto_map=True)
    return Launch(write_tiny_checkpoint(folder / MODEL_ID, "qwen3"),
                  ("--embedding-model", str(embedder), "--embedding-model", str(custom),
                   "--reranker-model", str(reranker)),
                  {"MTPLX_RETRIEVAL_RESIDENT_LIMIT": "1"})


api = daemon_fixture(launch)


def rerank(api, **body):
    return httpx.post(api.base_url + "/v1/rerank", json={"model": RERANKER, **body}, timeout=60)


def models(api, capability=None):
    params = {"capability": capability} if capability else {}
    return httpx.get(api.base_url + "/v1/models", params=params).json()["data"]


def test_models_list_stays_chat_only_unless_asked_and_retrieval_loads_lazily(api):
    assert [m["id"] for m in models(api)] == [MODEL_ID]
    assert [(m["id"], m["mtplx"]["loaded"]) for m in models(api, "rerank")] == [(RERANKER, False)]
    assert {m["id"] for m in models(api, "embedding")} == {EMBEDDER, CUSTOM}
    bad = httpx.get(api.base_url + "/v1/models", params={"capability": "vision"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "capability"


def test_openai_client_embeddings_are_unit_vectors_with_usage(api):
    reply = api.openai.embeddings.create(model=EMBEDDER, input="hello world")
    [item] = reply.data
    assert item.index == 0 and len(item.embedding) == 64
    assert abs(math.sqrt(sum(x * x for x in item.embedding)) - 1) < 1e-5
    assert reply.usage.prompt_tokens == reply.usage.total_tokens > 0
    assert reply.model == EMBEDDER


def test_a_text_embeds_the_same_in_a_batch_and_alone(api):
    batch = api.openai.embeddings.create(model=EMBEDDER, input=TEXTS + ["hello there"]).data
    for i, text in enumerate(TEXTS):
        alone = api.openai.embeddings.create(model=EMBEDDER, input=text).data[0].embedding
        assert max(abs(a - b) for a, b in zip(batch[i].embedding, alone)) < 1e-5
    assert [d.index for d in batch] == [0, 1, 2, 3]


def test_token_ids_dimensions_and_base64(api):
    ids = api.openai.embeddings.create(model=EMBEDDER, input=[[5, 6, 7], [8, 9]]).data
    assert len(ids) == 2 and len(ids[0].embedding) == 64
    single = api.openai.embeddings.create(model=EMBEDDER, input=[5, 6, 7]).data
    assert single[0].embedding == ids[0].embedding
    full = api.openai.embeddings.create(model=EMBEDDER, input="hello world").data[0].embedding
    short = api.openai.embeddings.create(model=EMBEDDER, input="hello world", dimensions=16).data[0].embedding
    head = np.array(full[:16])
    assert np.allclose(short, head / np.linalg.norm(head), atol=1e-6)
    raw = httpx.post(api.base_url + "/v1/embeddings", json={"model": EMBEDDER, "input": "hello world",
                                                            "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(decoded, full, atol=1e-7)
    # The SDK asks for base64 by default and decodes it: what it returns is the same vector.
    assert np.allclose(api.openai.embeddings.create(model=EMBEDDER, input="hello world").data[0].embedding, full)


@pytest.mark.parametrize("body,param", [
    ({"input": ""}, "input[0]"), ({"input": []}, "input"), ({"input": [1, "x"]}, "input[0]"),
    ({"input": "x", "dimensions": 65}, "dimensions"), ({"input": [[10 ** 6]]}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format")])
def test_bad_embedding_input_is_a_400_naming_the_field(api, body, param):
    reply = httpx.post(api.base_url + "/v1/embeddings", json={"model": EMBEDDER, **body})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param


def test_rerank_orders_documents_best_first_with_scores_that_do_not_depend_on_neighbours(api):
    reply = rerank(api, query="what is a KV cache", documents=DOCS)
    assert reply.status_code == 200
    results = reply.json()["results"]
    assert sorted(r["index"] for r in results) == [0, 1, 2, 3]
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True) and all(0 <= s <= 1 for s in scores)
    assert all(r["document"]["text"] == DOCS[r["index"]] for r in results)
    alone = rerank(api, query="what is a KV cache", documents=[DOCS[2]]).json()["results"][0]["relevance_score"]
    assert abs(alone - next(r["relevance_score"] for r in results if r["index"] == 2)) < 1e-5
    top = rerank(api, query="what is a KV cache", documents=[{"text": d} for d in DOCS], top_n=2,
                 return_documents=False).json()
    assert [r["index"] for r in top["results"]] == [r["index"] for r in results[:2]]
    assert "document" not in top["results"][0] and top["usage"]["total_tokens"] > 0


def test_the_resident_limit_keeps_the_most_recent_retrieval_model(api):
    api.openai.embeddings.create(model=EMBEDDER, input="x")
    rerank(api, query="q", documents=["d"])
    loaded = {m["id"]: m["mtplx"]["loaded"] for m in models(api, "embedding") + models(api, "rerank")}
    assert loaded == {EMBEDDER: False, CUSTOM: False, RERANKER: True}  # limit 1: the reranker stayed


def test_wrong_kinds_of_model_get_clear_errors(api):
    with pytest.raises(openai.BadRequestError) as chat:
        api.openai.chat.completions.create(model=EMBEDDER, messages=[{"role": "user", "content": "hi"}])
    assert chat.value.body["code"] == "wrong_model_kind"
    with pytest.raises(openai.BadRequestError):
        api.openai.embeddings.create(model=RERANKER, input="x")
    with pytest.raises(openai.BadRequestError):
        api.openai.embeddings.create(model=MODEL_ID, input="x")
    with pytest.raises(openai.NotFoundError):
        api.openai.embeddings.create(model="nope", input="x")
    with pytest.raises(openai.PermissionDeniedError) as custom:
        api.openai.embeddings.create(model=CUSTOM, input="x")
    assert "retrieval-trust-remote-code" in custom.value.body["message"]


def test_metrics_count_embeddings_and_rerank(api):
    api.openai.embeddings.create(model=EMBEDDER, input=["a", "b"])
    text = httpx.get(api.base_url + "/metrics").text
    assert 'mtplx_retrieval_requests_total{kind="embedding"}' in text
    assert 'mtplx_retrieval_requests_total{kind="rerank"}' in text
    assert 'mtplx_retrieval_inputs_total{kind="embedding"}' in text


def test_a_chat_stream_and_embeddings_run_side_by_side(api):
    import threading

    streamed: list[str] = []

    def chat() -> None:
        for chunk in api.openai.chat.completions.create(model=MODEL_ID, stream=True, max_tokens=40, temperature=0,
                                                        messages=[{"role": "user", "content": "count to ten"}]):
            if chunk.choices and chunk.choices[0].delta.content:
                streamed.append(chunk.choices[0].delta.content)

    worker = threading.Thread(target=chat)
    worker.start()
    vectors = [api.openai.embeddings.create(model=EMBEDDER, input=TEXTS * 8).data for _ in range(3)]
    worker.join(120)
    assert not worker.is_alive()
    whole = api.openai.chat.completions.create(model=MODEL_ID, max_tokens=40, temperature=0,
                                               messages=[{"role": "user", "content": "count to ten"}])
    # Interleaved with embedding batches on the model thread, the stream is what it is alone.
    assert "".join(streamed) == (whole.choices[0].message.content or "")
    assert all(len(v) == 24 for v in vectors)


def test_two_concurrent_first_embedding_requests_load_the_model_once(api):
    import threading

    rerank(api, query="q", documents=["d"])  # limit 1: the reranker in, the embedder out
    [card] = [m for m in models(api, "embedding") if m["id"] == EMBEDDER]
    assert card["mtplx"]["loaded"] is False
    start = threading.Barrier(2)
    vectors: list = []

    def embed() -> None:
        start.wait()
        vectors.append(api.openai.embeddings.create(model=EMBEDDER, input=TEXTS).data)

    workers = [threading.Thread(target=embed) for _ in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
    [after] = [m for m in models(api, "embedding") if m["id"] == EMBEDDER]
    assert after["mtplx"]["loaded"] is True and after["mtplx"]["loads"] == card["mtplx"]["loads"] + 1
    assert len(vectors) == 2 and [d.embedding for d in vectors[0]] == [d.embedding for d in vectors[1]]
