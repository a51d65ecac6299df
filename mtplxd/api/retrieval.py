"""OpenAI `/v1/embeddings` and Cohere/Jina-shape `/v1/rerank` over the retrieval models
(engine/retrieval.py). Work goes to the model-owner thread in batches of `BATCH` inputs, so a
chat stream waits at most one batch between its decode steps."""

from __future__ import annotations

import base64
import math
import secrets
from typing import Any

import numpy as np

from mtplxd.api.errors import APIError, invalid
from mtplxd.api.metrics import Metrics
from mtplxd.api.schemas import Reader
from mtplxd.engine.interface import EMBEDDING, RERANK, RetrievalError
from mtplxd.runtime import Runtime

BATCH = 16
MAX_INPUTS = 2048
CAPABILITIES = ("chat", EMBEDDING, RERANK)


def retrieval_id(runtime: Runtime, requested: str | None, kind: str) -> str:
    """The served id of the `kind` model a request names (or the first one, unnamed)."""
    specs = [s for s in runtime.retrieval.specs.values() if s.kind == kind]
    route = "/v1/embeddings" if kind == EMBEDDING else "/v1/rerank"
    if not specs:
        flag = f"--{'embedding' if kind == EMBEDDING else 'reranker'}-model PATH_OR_REPO"
        refused = runtime.retrieval_refused.get(kind)
        if refused:  # configured, but it named no model when the daemon started
            raise APIError(404, f"no {kind} model is served: the daemon started with "
                                f"{' and '.join(refused)}; restart it with one that loads "
                                f"(`mtplxctl restart {flag}`)", code="model_not_found", param="model")
        raise APIError(404, f"no {kind} model is configured; start the daemon with {flag}",
                       code="model_not_found", param="model")
    if requested is None:
        return specs[0].id
    if any(s.id == requested for s in specs):
        return requested
    other = runtime.retrieval.specs.get(requested)
    if other is not None or (runtime.model is not None and runtime.model.info.id == requested):
        what = f"a {other.kind} model" if other is not None else "the chat model"
        raise invalid(f"{requested} is {what}; {route} serves {', '.join(s.id for s in specs)}", "model",
                      code="wrong_model_kind")
    raise APIError(404, f"the model {requested!r} is not served at {route} (it serves "
                        f"{', '.join(s.id for s in specs)})", code="model_not_found", param="model")


def refuse_chat_on_retrieval_model(runtime: Runtime, requested: str | None) -> None:
    """A chat request naming an embedding or reranker model: a clear 400."""
    spec = runtime.retrieval.specs.get(requested) if requested else None
    if spec is not None:
        route = "/v1/embeddings" if spec.kind == EMBEDDING else "/v1/rerank"
        raise invalid(f"{requested} is a {spec.kind} model and cannot chat; send it to {route}", "model",
                      code="wrong_model_kind")


async def _on_model(runtime: Runtime, model_id: str, fn: Any) -> Any:
    try:
        return await runtime.run_retrieval(model_id, fn)
    except RetrievalError as exc:
        if exc.code == "remote_code":
            raise APIError(403, str(exc), code="remote_code_refused", param="model") from None
        raise APIError(503, str(exc), code="model_load_failed", param="model") from None


# -- embeddings ---------------------------------------------------------------------------

def _inputs(body: Reader) -> list[str | list[int]]:
    raw = body.raw("input")
    if isinstance(raw, str):
        items: list[Any] = [raw]
    elif isinstance(raw, list) and raw and all(_is_token(t) for t in raw):
        items = [raw]
    elif isinstance(raw, list) and raw:
        items = raw
    else:
        raise invalid("`input` must be a string, an array of strings, an array of token ids or an "
                      "array of token-id arrays, and not empty", "input")
    if len(items) > MAX_INPUTS:
        raise invalid(f"`input` has {len(items)} items; at most {MAX_INPUTS} per request", "input")
    for i, item in enumerate(items):
        if isinstance(item, str) and item:
            continue
        if isinstance(item, list) and item and all(_is_token(t) for t in item):
            continue
        raise invalid(f"`input[{i}]` must be a non-empty string or a non-empty array of token ids",
                      f"input[{i}]")
    return items


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _render_vector(vector: list[float], dimensions: int | None, encoding: str) -> list[float] | str:
    if dimensions is not None:
        # Matryoshka: the leading dimensions carry the most; renormalised to unit length.
        head = vector[:dimensions]
        norm = math.sqrt(sum(x * x for x in head)) or 1.0
        vector = [x / norm for x in head]
    if encoding == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector


async def embeddings(runtime: Runtime, metrics: Metrics, data: dict[str, Any]) -> tuple[dict, int]:
    """POST /v1/embeddings."""
    body = Reader(data)
    model_id = retrieval_id(runtime, body.str("model"), EMBEDDING)
    items = _inputs(body)
    dimensions = body.int("dimensions", low=1)
    encoding = body.str("encoding_format", "float", choices=("float", "base64"))

    def tokenize(model: Any) -> list[list[int]]:
        ids = [model.tokenize(item) if isinstance(item, str) else list(item) for item in items]
        for i, one in enumerate(ids):
            if max(one) >= model.vocab_size:
                raise ValueError(f"`input[{i}]` has token ids outside the vocabulary (size {model.vocab_size})")
        return ids

    try:
        token_ids = await _on_model(runtime, model_id, tokenize)
    except ValueError as exc:
        raise invalid(str(exc), "input") from None
    vectors: list[list[float]] = []
    for start in range(0, len(token_ids), BATCH):
        batch = token_ids[start:start + BATCH]
        vectors += await _on_model(runtime, model_id, lambda m, batch=batch: m.embed(batch))
    size = len(vectors[0])
    if dimensions is not None and dimensions > size:
        raise invalid(f"`dimensions` {dimensions} is more than the model's {size}", "dimensions")
    tokens = sum(len(ids) for ids in token_ids)
    metrics.observe_retrieval(EMBEDDING, len(items), tokens)
    return {
        "object": "list", "model": model_id,
        "data": [{"object": "embedding", "index": i, "embedding": _render_vector(v, dimensions, encoding)}
                 for i, v in enumerate(vectors)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }, 200


# -- rerank -------------------------------------------------------------------------------

def _documents(body: Reader) -> list[str]:
    raw = body.list("documents", required=True)
    if not raw:
        raise invalid("`documents` must not be empty", "documents")
    if len(raw) > MAX_INPUTS:
        raise invalid(f"`documents` has {len(raw)} items; at most {MAX_INPUTS} per request", "documents")
    out = []
    for i, doc in enumerate(raw):
        if isinstance(doc, dict):
            doc = Reader(doc, f"documents[{i}]").str("text", required=True)
        if not isinstance(doc, str):
            raise invalid(f"`documents[{i}]` must be a string or an object with `text`", f"documents[{i}]")
        out.append(doc)
    return out


async def rerank(runtime: Runtime, metrics: Metrics, data: dict[str, Any]) -> tuple[dict, int]:
    """POST /v1/rerank: documents ordered by relevance to the query, best first."""
    body = Reader(data)
    model_id = retrieval_id(runtime, body.str("model"), RERANK)
    query = body.str("query", required=True)
    if not query:
        raise invalid("`query` must not be empty", "query")
    documents = _documents(body)
    top_n = body.int("top_n", low=1)
    return_documents = bool(body.bool("return_documents", True))
    instruction = body.str("instruction")
    pairs = await _on_model(runtime, model_id, lambda m: m.rerank_inputs(query, documents, instruction))
    scores: list[float] = []
    for start in range(0, len(pairs), BATCH):
        batch = pairs[start:start + BATCH]
        scores += await _on_model(runtime, model_id, lambda m, batch=batch: m.score(batch))
    order = sorted(range(len(documents)), key=lambda i: (-scores[i], i))[:top_n]
    results = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if return_documents:
            result["document"] = {"text": documents[i]}
        results.append(result)
    tokens = sum(len(p) for p in pairs)
    metrics.observe_retrieval(RERANK, len(documents), tokens)
    return {"id": "rerank-" + secrets.token_hex(12), "model": model_id, "results": results,
            "usage": {"total_tokens": tokens}}, 200


# -- models -------------------------------------------------------------------------------

def retrieval_cards(runtime: Runtime, capability: str) -> list[dict[str, Any]]:
    """`/v1/models?capability=...` entries of the retrieval models of that capability."""
    resident = set(runtime.retrieval.resident())
    return [{"id": s.id, "object": "model", "created": 0, "owned_by": "mtplx",
             "mtplx": {"capability": s.kind, "loaded": s.id in resident,
                       "loads": runtime.retrieval.loads.get(s.id, 0)}}
            for s in runtime.retrieval.specs.values() if s.kind == capability]
