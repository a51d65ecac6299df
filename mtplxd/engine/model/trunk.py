"""The target model's forward, giving post-norm hidden states as well as logits.

For registered families the text model is split into its body (embeddings, layers, final
norm: the post-norm hidden h that the MTP head reads) and its lm_head. For any other
mlx-lm model the whole `model(tokens, cache)` call is used and no hidden is available.
The AR path and the speculative path call the same functions, in the same prefill chunks,
so their numerics match (bitwise on the CPU backend).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Generator, TypeVar

import mlx.core as mx
import mlx.nn as nn

from mtplxd.engine.model.families import FamilySpec, default_make_cache
from mtplxd.engine.model.kv_cache import bucket_kv_caches, fixed_shapes_wanted, quantize_kv_caches

PREFILL_CHUNK = 512  # tokens per prefill forward; fixed so every path splits prompts alike


def default_decode_loop() -> str:
    """The MTP loop `auto` picks: fused where it measured faster than stepwise (CUDA; the CPU
    backend, by up to a tenth at T=0.6), stepwise on Metal, where neither is measured."""
    return "fused" if fixed_shapes_wanted() or mx.default_device() == mx.cpu else "stepwise"


class Trunk:
    """Forward passes over the target model with a cache the caller owns."""

    def __init__(self, model: nn.Module, spec: FamilySpec | None) -> None:
        self.model = model
        self.spec = spec
        self.text = spec.text_model(model) if spec is not None else None
        # qwen3_next's body embeds its tokens itself and takes no input embeddings.
        self._body_takes_embeddings = self.text is not None and (
            "input_embeddings" in inspect.signature(self.text.model.__call__).parameters)
        self._draft_head: tuple | None = None  # (weight, scales, biases, group_size, bits)
        # Bucketed KV (shapes change every 256 tokens) where the backend compiles per shape.
        self.fixed_shapes = spec is not None and fixed_shapes_wanted()
        # MTP decode loop for all-attention caches: "fused" (each cycle one compiled device
        # graph, read back a cycle late: fused.py) or "stepwise" (speculative.py). AR requests
        # always run autoregressive.py.
        self.decode_loop = default_decode_loop()
        # The fused loop's compiled graphs, by (loop kind, depth, sampling settings): fused.py.
        self.compiled_graphs: dict[tuple, Any] = {}
        # Attention KV quantization (0 = full precision) and its group size (loader sets both).
        self.kv_bits = 0
        self.kv_group_size = 64

    @property
    def has_hidden(self) -> bool:
        """True when forward() can return post-norm hidden states (MTP-capable)."""
        return self.text is not None

    def make_cache(self) -> list[Any]:
        """A fresh trunk cache (every entry must support `trim(n)` for speculation)."""
        make = self.spec.make_cache if self.spec is not None else default_make_cache
        cache = make(self.model)
        if self.kv_bits:
            # Quantized KV is not bucketed: its attention runs mlx-lm's quantized kernels.
            return quantize_kv_caches(cache, self.kv_bits, self.kv_group_size)
        return bucket_kv_caches(cache) if self.fixed_shapes else cache

    def make_head_cache(self, head: nn.Module) -> list[Any]:
        """A fresh cache for the MTP head, bucketed like the trunk's."""
        cache = head.make_cache()
        return bucket_kv_caches(cache) if self.fixed_shapes else cache

    def embed(self, tokens: mx.array) -> mx.array:
        """Input embeddings of (B, L) tokens (shared with the MTP head)."""
        return self.text.model.embed_tokens(tokens)

    def input_embedding(self, tokens: mx.array) -> mx.array:
        """The trunk's own input embeddings of (B, L) tokens, for any family (a prompt with
        images splices the vision tower's rows into them)."""
        if self.text is not None:
            return self.embed(tokens)
        inner = getattr(self.model, "language_model", self.model)
        return inner.model.embed_tokens(tokens)

    def lm_head(self, hidden: mx.array) -> mx.array:
        """Logits from post-norm hidden states."""
        if self._tied():
            return self.text.model.embed_tokens.as_linear(hidden)
        return self.text.lm_head(hidden)

    def draft_logits(self, hidden: mx.array) -> mx.array:
        """Logits for MTP drafts: the quantized draft head when one is set, else lm_head.

        Drafts are only proposals (T=0) or samples from a q that the acceptance rule
        accounts for (T>0), so a cheaper head changes acceptance, never the output.
        """
        if self._draft_head is None:
            return self.lm_head(hidden)
        weight, scales, biases, group_size, bits = self._draft_head
        return mx.quantized_matmul(hidden, weight, scales, biases, transpose=True,
                                   group_size=group_size, bits=bits)

    def quantize_draft_head(self, bits: int = 4, group_size: int = 64) -> bool:
        """Give drafting its own `bits`-bit copy of lm_head; False when lm_head is already
        quantized (drafting then shares it). Each draft step reads the whole lm_head, which
        for a 150k vocabulary is a sizeable fraction of a small model's weights."""
        source = self.text.model.embed_tokens if self._tied() else self.text.lm_head
        if hasattr(source, "scales"):
            return False
        weight, scales, biases = mx.quantize(source.weight, group_size=group_size, bits=bits)
        mx.eval(weight, scales, biases)
        self._draft_head = (weight, scales, biases, group_size, bits)
        return True

    def _tied(self) -> bool:
        return getattr(self.text.args, "tie_word_embeddings", False) or not hasattr(self.text, "lm_head")

    def forward(self, tokens: mx.array, cache: list[Any], *, all_logits: bool,
                embeddings: mx.array | None = None) -> tuple[mx.array | None, mx.array]:
        """Run (1, L) tokens; return (hidden (1,L,H) or None, logits (1,L',V)).

        L' is L when `all_logits`, else 1 (the last position: prefill never materialises
        a (L, vocab) matrix it does not need). `embeddings` (1, L, H) replace the tokens'
        own input embeddings (a prompt with images).
        """
        if self.text is None:
            extra = {} if embeddings is None else {"input_embeddings": embeddings}
            logits = self.model(tokens, cache=cache, **extra)
            return None, logits if all_logits else logits[:, -1:, :]
        hidden = self.body(tokens, cache, embeddings)
        rows = hidden if all_logits else hidden[:, -1:, :]
        return hidden, self.lm_head(rows)

    def input_hidden(self, tokens: mx.array, embeddings: mx.array | None = None) -> mx.array:
        """What the first layer reads: the given input `embeddings` (a prompt with images),
        else the tokens' own. The one embedding step of every forward (pipeline's included)."""
        return self.embed(tokens) if embeddings is None else embeddings

    def body(self, tokens: mx.array, cache: list[Any],
             embeddings: mx.array | None = None) -> mx.array:
        """Post-norm hidden (1, L, H) of the text body over (1, L) tokens, or over the given
        input `embeddings`. A trunk whose layers live elsewhere overrides this, not forward."""
        if not self._body_takes_embeddings:
            if embeddings is not None:
                raise ValueError(f"{type(self.text.model).__name__} takes no input embeddings")
            return self.text.model(tokens, cache)
        return self.text.model(tokens, cache, input_embeddings=self.input_hidden(tokens, embeddings))

    def prefill(self, prompt_ids: list[int], cache: list[Any],
                chunk_size: int = PREFILL_CHUNK, *,
                should_stop: Callable[[], bool] | None = None,
                ) -> tuple[list[mx.array], mx.array] | None:
        """Feed the prompt in `chunk_size` pieces; return (hidden chunks, last-row logits (V,)).

        Returns None when `should_stop()` turns True between two chunks, so a long prompt
        can be cancelled before it is fully read.
        """
        return run_steps(self.prefill_steps(prompt_ids, cache, chunk_size, should_stop=should_stop))

    def prefill_steps(self, prompt_ids: list[int], cache: list[Any],
                      chunk_size: int = PREFILL_CHUNK, *,
                      should_stop: Callable[[], bool] | None = None,
                      embeddings: mx.array | None = None,
                      ) -> Generator[PrefillChunk, Any, tuple[list[mx.array], mx.array] | None]:
        """`prefill` one chunk per step: yields a PrefillChunk for every chunk, which must be
        sent its answer (`run_steps` runs each alone; the scheduler may batch the chunks of
        several rows), and None between two chunks (a step boundary: other rows run there);
        returns what `prefill` returns. `embeddings` (1, len(prompt), H): the prompt's input
        embeddings (images spliced in)."""
        hiddens: list[mx.array] = []
        logits = None
        for start in range(0, len(prompt_ids), chunk_size):
            if start:
                yield None
                if should_stop is not None and should_stop():
                    return None
            chunk = mx.array(prompt_ids[start:start + chunk_size])[None]
            rows = None if embeddings is None else embeddings[:, start:start + chunk_size]
            hidden, logits = yield PrefillChunk(self, chunk, cache, rows, position=start)
            if hidden is not None:
                hiddens.append(hidden)
        assert logits is not None, "empty prompt"
        return hiddens, logits[0, -1]


@dataclass
class PrefillChunk:
    """One prefill forward a prompt's prefill asks for: (1, n) tokens onto a row's cache.

    Whoever drives the prefill answers it with (hidden (1, n, H) or None, logits (1, 1, V)),
    evaluated: `run()` alone, or the scheduler with other rows' chunks in one batched
    forward (cohort.run_prefills)."""

    trunk: Trunk
    tokens: mx.array
    cache: list[Any]
    embeddings: mx.array | None = None
    position: int = 0  # the row's tokens before this chunk (its cache's length)

    @property
    def length(self) -> int:
        return int(self.tokens.shape[1])

    def run(self) -> tuple[mx.array | None, mx.array]:
        """The chunk's forward on its own, evaluated."""
        hidden, logits = self.trunk.forward(self.tokens, self.cache, all_logits=False,
                                            embeddings=self.embeddings)
        mx.eval(logits, hidden if hidden is not None else logits)
        return hidden, logits


T = TypeVar("T")


def run_steps(steps: Generator[Any, Any, T]) -> T:
    """Drive a step generator (`prefill_steps` and kin) to its end, answering each
    PrefillChunk alone; return its value."""
    answer = None
    while True:
        try:
            item = steps.send(answer)
        except StopIteration as done:
            return done.value
        answer = item.run() if isinstance(item, PrefillChunk) else None
