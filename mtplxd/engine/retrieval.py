"""Embedding and reranker models (Qwen3-Embedding / Qwen3-Reranker kind) on mlx-lm's classes.

They share nothing with the chat model's MTP path: mlx-lm builds the model, and
- an embedder returns the L2-normalised final hidden state of each input's last token
  (Qwen3-Embedding's last-token pooling; a text input gets the end-of-text token appended,
  as its tokenizer's post-processor does); inputs of equal length run as one batch, so an
  input's vector does not depend on its neighbours beyond float rounding;
- a reranker reads each (query, document) pair through Qwen3-Reranker's yes/no prompt and
  scores it P("yes") = softmax([logit(no), logit(yes)]) at the last position.

A `RetrievalPool` keeps at most `limit` of them resident (least recently used goes first)
and loads one on its first request. Everything here runs on the model-owner thread.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from mtplxd.engine.interface import EMBEDDING, RERANK, RetrievalError

RERANK_SYSTEM = ('Judge whether the Document meets the requirements based on the Query and the '
                 'Instruct provided. Note that the answer can only be "yes" or "no".')
RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
RERANK_PREFIX = f"<|im_start|>system\n{RERANK_SYSTEM}<|im_end|>\n<|im_start|>user\n"
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


@dataclass(frozen=True)
class RetrievalSpec:
    """A configured retrieval model: its served id, folder and kind."""

    id: str
    path: Path
    kind: str  # EMBEDDING | RERANK


class RetrievalModel:
    """A loaded embedder or reranker."""

    def __init__(self, spec: RetrievalSpec, model: Any, tokenizer: Any) -> None:
        self.spec, self.model, self.tokenizer = spec, model, tokenizer
        self.eos_id = tokenizer.eos_token_id
        self.vocab_size = int(model.model.embed_tokens.weight.shape[0])
        if spec.kind == RERANK:
            self.yes_id, self.no_id = _single_token(tokenizer, "yes"), _single_token(tokenizer, "no")
            if self.yes_id is None or self.no_id is None:
                raise RetrievalError("not_reranker", f"{spec.id} is not a yes/no reranker: its tokenizer "
                                                     "has no single `yes` and `no` tokens")

    def tokenize(self, text: str) -> list[int]:
        """An input text as the model reads it (end-of-text appended for embeddings)."""
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        return ids + [self.eos_id] if self.eos_id is not None else ids

    def embed(self, inputs: list[list[int]]) -> list[list[float]]:
        """Unit-length last-token embeddings of token-id inputs, in order."""
        out: list[list[float] | None] = [None] * len(inputs)
        for length, indices in _by_length(inputs).items():
            hidden = self.model.model(mx.array([inputs[i] for i in indices]))[:, -1, :].astype(mx.float32)
            hidden = hidden / mx.maximum(mx.linalg.norm(hidden, axis=-1, keepdims=True), 1e-12)
            for i, row in zip(indices, hidden.tolist()):
                out[i] = row
        return out  # type: ignore[return-value]

    def rerank_inputs(self, query: str, documents: list[str], instruction: str | None) -> list[list[int]]:
        """The token ids of each (query, document) pair in the reranker's prompt."""
        prefix = self.tokenizer.encode(RERANK_PREFIX, add_special_tokens=False)
        suffix = self.tokenizer.encode(RERANK_SUFFIX, add_special_tokens=False)
        task = instruction or RERANK_INSTRUCTION
        return [prefix + self.tokenizer.encode(f"<Instruct>: {task}\n<Query>: {query}\n<Document>: {doc}",
                                               add_special_tokens=False) + suffix
                for doc in documents]

    def score(self, pairs: list[list[int]]) -> list[float]:
        """P(yes) for each prepared pair, in order."""
        out: list[float] = [0.0] * len(pairs)
        for length, indices in _by_length(pairs).items():
            logits = self.model(mx.array([pairs[i] for i in indices]))[:, -1, :].astype(mx.float32)
            two = mx.stack([logits[:, self.no_id], logits[:, self.yes_id]], axis=-1)
            for i, p in zip(indices, mx.softmax(two, axis=-1)[:, 1].tolist()):
                out[i] = p
        return out


def _single_token(tokenizer: Any, word: str) -> int | None:
    ids = tokenizer.encode(word, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def _by_length(inputs: list[list[int]]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for i, ids in enumerate(inputs):
        groups.setdefault(len(ids), []).append(i)
    return groups


def load_retrieval_model(spec: RetrievalSpec, trust_remote_code: bool = False) -> RetrievalModel:
    """Load `spec` with mlx-lm. A checkpoint that ships its own Python (`auto_map`) is refused
    unless `trust_remote_code`: loading it would mean running that code's expectations."""
    try:
        config = json.loads((spec.path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise RetrievalError("load_failed", f"{spec.id}: cannot read {spec.path / 'config.json'}: {exc}") from None
    if config.get("auto_map") and not trust_remote_code:
        raise RetrievalError("remote_code", f"{spec.id} ships its own Python code (`auto_map` in its "
                                            "config.json); start the daemon with "
                                            "--retrieval-trust-remote-code to serve it anyway")
    from mlx_lm.utils import load

    try:
        model, tokenizer = load(str(spec.path))
    except Exception as exc:  # mlx-lm raises many kinds; the message is what the user needs
        raise RetrievalError("load_failed", f"{spec.id} could not be loaded: {exc}") from None
    return RetrievalModel(spec, model, tokenizer)


class RetrievalPool:
    """The configured retrieval models, at most `limit` resident, loaded on first use."""

    def __init__(self, specs: list[RetrievalSpec], limit: int = 2, trust_remote_code: bool = False) -> None:
        self.specs = {spec.id: spec for spec in specs}
        self.limit = max(1, limit)
        self.trust_remote_code = trust_remote_code
        self._resident: OrderedDict[str, RetrievalModel] = OrderedDict()

    def get(self, model_id: str) -> RetrievalModel:
        """The model `model_id`, loading it (and evicting the least recently used) if needed."""
        if model_id in self._resident:
            self._resident.move_to_end(model_id)
            return self._resident[model_id]
        model = load_retrieval_model(self.specs[model_id], self.trust_remote_code)
        self._resident[model_id] = model
        while len(self._resident) > self.limit:
            self._resident.popitem(last=False)
        return model

    def resident(self) -> list[str]:
        """Ids of the loaded models, least recently used first."""
        return list(self._resident)

    def release(self) -> int:
        """Drop every resident model (memory pressure); returns how many were dropped."""
        count = len(self._resident)
        self._resident.clear()
        if count:
            mx.clear_cache()
        return count
