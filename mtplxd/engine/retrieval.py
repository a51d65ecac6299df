"""Embedding and reranker models (Qwen3-Embedding / Qwen3-Reranker kind) on mlx-lm's classes.

They share nothing with the chat model's MTP path: mlx-lm builds the model, and
- an embedder returns the L2-normalised final hidden state of each input's last token
  (Qwen3-Embedding's last-token pooling; a text input gets the end-of-text token appended,
  as its tokenizer's post-processor does); inputs of equal length run as one batch, so an
  input's vector does not depend on its neighbours beyond float rounding;
- a reranker reads each (query, document) pair through Qwen3-Reranker's yes/no prompt and
  scores it P("yes") = softmax([logit(no), logit(yes)]) at the last position.

A `RetrievalPool` keeps at most `limit` of them resident (least recently used goes first)
and loads one on its first request, in slices of weights small enough that the owner thread
can turn the chat scheduler between them. Everything here runs on the model-owner thread.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from functools import partial
from typing import Any, Callable, TypeVar

import mlx.core as mx

from mtplxd.engine.interface import EMBEDDING, RERANK, RetrievalError

T = TypeVar("T")

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


SLICE_BYTES = 64 * 1024 * 1024  # weights read per load step: a step stalls chat rows about as long as a batch


class RetrievalLoad:
    """A retrieval model being loaded in slices on the owner thread: built with its weights
    still on disk (`begin_retrieval_load`), then `steps` run one by one (the tokenizer, then
    each slice of about `slice_bytes` of weights, read and evaluated), then `finish`. Between
    two steps the owner thread is free to turn the chat scheduler. Every failure is a
    RetrievalError("load_failed")."""

    def __init__(self, spec: RetrievalSpec, model: Any, config: dict, slice_bytes: int) -> None:
        from mlx.utils import tree_flatten

        self.spec, self.model, self.config = spec, model, config
        self.tokenizer: Any = None
        weights = [array for _, array in tree_flatten(model.parameters())]
        self.steps = [self._load_tokenizer] + [partial(_evaluate, part) for part in _slices(weights, slice_bytes)]

    def run_step(self, index: int) -> None:
        """Run step `index` (0 <= index < len(steps))."""
        self._guarded(self.steps[index])

    def finish(self) -> RetrievalModel:
        """The loaded model, once every step has run."""
        return self._guarded(lambda: RetrievalModel(self.spec, self.model, self.tokenizer))

    def run_all(self) -> RetrievalModel:
        """Every step, then `finish`, in one go (what one owner job of the old load did)."""
        for index in range(len(self.steps)):
            self.run_step(index)
        return self.finish()

    def _load_tokenizer(self) -> None:
        from mlx_lm.utils import load_tokenizer

        self.tokenizer = load_tokenizer(self.spec.path, eos_token_ids=self.config.get("eos_token_id"))

    def _guarded(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except RetrievalError:
            raise
        except Exception as exc:  # mlx-lm and MLX raise many kinds; the message is what the user needs
            raise RetrievalError("load_failed", f"{self.spec.id} could not be loaded: {exc}") from None


def _slices(weights: list[mx.array], slice_bytes: int) -> list[list[mx.array]]:
    """`weights` in order, cut into runs of about `slice_bytes` (an array larger than that is
    a run of its own: one array is read whole)."""
    out: list[list[mx.array]] = []
    size = slice_bytes
    for array in weights:
        if size + array.nbytes > slice_bytes and size > 0:
            out.append([])
            size = 0
        out[-1].append(array)
        size += array.nbytes
    return out


def _evaluate(arrays: list[mx.array]) -> None:
    mx.eval(arrays)


def begin_retrieval_load(spec: RetrievalSpec, trust_remote_code: bool = False,
                         slice_bytes: int = SLICE_BYTES) -> RetrievalLoad:
    """Start loading `spec`: its modules are built and its weight files mapped, no weight is
    read yet. A checkpoint that ships its own Python (`auto_map`) is refused first, unless
    `trust_remote_code`: loading it would mean running that code's expectations."""
    try:
        config = json.loads((spec.path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise RetrievalError("load_failed", f"{spec.id}: cannot read {spec.path / 'config.json'}: {exc}") from None
    if config.get("auto_map") and not trust_remote_code:
        raise RetrievalError("remote_code", f"{spec.id} ships its own Python code (`auto_map` in its "
                                            "config.json); start the daemon with "
                                            "--retrieval-trust-remote-code to serve it anyway")
    from mlx_lm.utils import load_model

    try:
        model, config = load_model(spec.path, lazy=True)
    except Exception as exc:  # mlx-lm raises many kinds; the message is what the user needs
        raise RetrievalError("load_failed", f"{spec.id} could not be loaded: {exc}") from None
    return RetrievalLoad(spec, model, config, slice_bytes)


def load_retrieval_model(spec: RetrievalSpec, trust_remote_code: bool = False) -> RetrievalModel:
    """Load `spec` whole, in one go (see `begin_retrieval_load` for the checks)."""
    return begin_retrieval_load(spec, trust_remote_code).run_all()


class RetrievalPool:
    """The configured retrieval models, at most `limit` resident, loaded on first use.

    A load can run in one go (`get`) or split into owner-thread jobs, so chat rows decode
    between them: `begin_load`, then `load_step` for each step, then `finish_load`. The load in
    progress stays here, on the owner thread; the caller only passes ids and step numbers."""

    def __init__(self, specs: list[RetrievalSpec], limit: int = 2, trust_remote_code: bool = False,
                 slice_bytes: int = SLICE_BYTES) -> None:
        self.specs = {spec.id: spec for spec in specs}
        self.limit = max(1, limit)
        self.trust_remote_code = trust_remote_code
        self.slice_bytes = slice_bytes
        self.loads: dict[str, int] = {}  # completed loads per id (a reload after eviction counts)
        self._resident: OrderedDict[str, RetrievalModel] = OrderedDict()
        self._loading: dict[str, RetrievalLoad] = {}

    def get(self, model_id: str) -> RetrievalModel:
        """The model `model_id`, loading it whole (and evicting the least recently used) if
        needed. For callers with the owner thread to themselves (tools, tests); the daemon
        loads in steps (`begin_load`) and runs on `resident_model`."""
        model = self.resident_model(model_id)
        if model is not None:
            return model
        load = begin_retrieval_load(self.specs[model_id], self.trust_remote_code, self.slice_bytes)
        return self._register(model_id, load.run_all())

    def resident_model(self, model_id: str) -> RetrievalModel | None:
        """The loaded model `model_id` (now the most recently used), or None if it is not
        loaded: evicted by memory pressure or another model's load since it was."""
        model = self._resident.get(model_id)
        if model is not None:
            self._resident.move_to_end(model_id)
        return model

    def is_resident(self, model_id: str) -> bool:
        """True when `model_id` is loaded (safe to ask from any thread)."""
        return model_id in self._resident

    def begin_load(self, model_id: str) -> int:
        """Start loading `model_id` (no weight read yet); returns its number of steps."""
        load = begin_retrieval_load(self.specs[model_id], self.trust_remote_code, self.slice_bytes)
        self._loading[model_id] = load
        return len(load.steps)

    def load_step(self, model_id: str, index: int) -> None:
        """Run step `index` of the load in progress; a failure drops the whole load."""
        try:
            self._loading[model_id].run_step(index)
        except RetrievalError:
            self.abandon_load(model_id)
            raise

    def finish_load(self, model_id: str) -> RetrievalModel:
        """Make the loaded model resident, evicting the least recently used past `limit`."""
        try:
            model = self._loading.pop(model_id).finish()
        except RetrievalError:
            mx.clear_cache()
            raise
        return self._register(model_id, model)

    def _register(self, model_id: str, model: RetrievalModel) -> RetrievalModel:
        self._resident[model_id] = model
        self.loads[model_id] = self.loads.get(model_id, 0) + 1
        while len(self._resident) > self.limit:
            self._resident.popitem(last=False)
        return model

    def abandon_load(self, model_id: str) -> None:
        """Drop the load in progress of `model_id`, if any, and the weights it read."""
        if self._loading.pop(model_id, None) is not None:
            mx.clear_cache()

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
