"""The engine's public data types: what the daemon sends in and what it gets back.

Plain dataclasses, no MLX, so the API and control layers can import them cheaply.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


class ModelLoadError(Exception):
    """A checkpoint was refused or could not be loaded; the message says what to do."""


class GroupLost(RuntimeError):
    """A distributed serving group lost a rank (died, hung past its deadline); the message
    says which and why. Requests fail with 503 until the group is back (engine/distributed)."""


EMBEDDING, RERANK = "embedding", "rerank"  # the kinds of retrieval model (engine/retrieval.py)


class RetrievalError(Exception):
    """A retrieval model cannot serve: `code` says why (remote_code, load_failed, not_reranker)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class QueueFull(Exception):
    """The scheduler's admission queue holds `max_queued` requests already (an HTTP 429)."""

    def __init__(self, queued: int, retry_after_seconds: int) -> None:
        super().__init__(f"{queued} requests are already waiting for a generation slot; "
                         f"retry in about {retry_after_seconds}s")
        self.queued = queued
        self.retry_after_seconds = retry_after_seconds


# How MTP requests decode: "fused" (fused.py), "stepwise" (speculative.py), or "auto"
# (trunk.default_decode_loop: fused on CUDA and CPU, stepwise on Metal).
DECODE_LOOP_CHOICES = ("auto", "fused", "stepwise")
# Quantizing an unquantized checkpoint as it loads: "auto" (what the checkpoint's config asks
# for on this backend: loader.CUDA_QUANTIZATION_KEY), "none", or MLX affine "8bit" / "4bit".
QUANTIZE_CHOICES = ("auto", "none", "8bit", "4bit")
# What a model computes in: "auto" (loader.compute_dtype: float32 on the Linux CPU, else the
# checkpoint's) or "checkpoint" (the checkpoint's own dtype anywhere: half the KV memory on
# the Linux CPU, at the speed bench.cpu_dtype measures).
COMPUTE_CHOICES = ("auto", "checkpoint")
# Whether a quantized model computed in float32 (the Linux CPU) gets dense float32 weights:
# "auto" (while they fit in half the memory limit: loader.DEQUANTIZE_MEMORY_SHARE), "on", "off".
DEQUANTIZE_CHOICES = ("auto", "on", "off")

@dataclass
class SamplingParams:
    """How to pick tokens. Temperature 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)  # stop strings (not included in output)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # benchmarks: decode max_tokens whatever the model says

    @property
    def greedy(self) -> bool:
        """True when tokens are picked by argmax."""
        return self.temperature <= 0.0

    @property
    def has_penalties(self) -> bool:
        """True when any context-dependent penalty changes the logits."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


@dataclass(frozen=True)
class RepetitionPolicy:
    """When the runaway-loop guard ends a generation (engine/decoding/repetition.py): a span
    of at most `max_period` tokens repeated `min_repeats` times over at least `min_tokens`
    tokens. Text is held back once `hold_tokens` tokens of a span repeat, and released when
    the repetition breaks; if it becomes a loop, the held text is dropped."""

    min_tokens: int = 128
    min_repeats: int = 6
    max_period: int = 256
    hold_tokens: int = 16


@dataclass
class PreparedImage:
    """An image ready for the vision tower: preprocessed pixels (a numpy array, no MLX), its
    patch grid, how many prompt rows it fills, and the sha256 of its bytes (the session bank
    keys image rows by it)."""

    digest: str
    tokens: int
    grid_thw: tuple[int, int, int]
    pixel_values: Any = field(repr=False, default=None)
    # Peak bytes the vision tower needs for it (pixels, activations, attention scores, the
    # output rows): the memory guard adds them to the request's price.
    price_bytes: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes of its preprocessed pixels."""
        return int(getattr(self.pixel_values, "nbytes", 0))


@dataclass
class GenerationRequest:
    """One completion: prompt token ids, sampling, and the MTP depth (0 = plain AR)."""

    prompt_ids: list[int]
    sampling: SamplingParams
    depth: int | None = None  # None = the model's configured depth; 0 = plain AR
    # Tokens per prefill forward; the memory guard lowers it when a long prompt would not fit.
    prefill_chunk: int | None = None
    # Conversation id from the client (x-session-id & co.): groups session-bank entries for
    # LRU; prefix reuse itself works without it.
    session_id: str | None = None
    # When the request arrived (time.perf_counter()): TTFT and queue wait count from here.
    # None: the scheduler stamps it at submission.
    arrived_at: float | None = None
    # The caller's id for this request (the API's request id), shown in scheduler snapshots.
    request_id: str | None = None
    # Images in the prompt, in order; each fills a run of the model's image-placeholder ids.
    images: list[PreparedImage] = field(default_factory=list)
    # The runaway-loop guard; None = off.
    repetition: RepetitionPolicy | None = None
    # Log-probabilities of the generated tokens with this many alternatives each (0 to 20);
    # None = not asked for (decoding/logprobs.py).
    logprobs: int | None = None


@dataclass
class TokenLogprob:
    """One generated token's log-probability and its `top` alternatives (id, logprob), best first."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class TokenDelta:
    """Tokens committed in one step and the text they completed (may be "" mid-character)."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked


@dataclass
class GenerationStats:
    """What one request lived: sizes, speculative acceptance and timings."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    depth: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_by_depth: list[int] = field(default_factory=list)
    accepted_by_depth: list[int] = field(default_factory=list)
    mean_accepted_length: float = 1.0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    prefill_tokens_per_second: float = 0.0
    decode_tokens_per_second: float = 0.0
    ttft_seconds: float = 0.0
    finish_reason: str = "length"
    cycles: int = 0
    queue_wait_seconds: float = 0.0  # arrival to admission (waiting for a row slot / memory)
    prefill_chunks: int = 0  # prefill forwards; the scheduler ran other rows between them
    restored_from: str = "cold"  # where the reused prompt prefix came from: cold | ram | ssd
    rows_max: int = 1  # the most rows running at once (this one included) while it ran
    # Decode samples about once a second (rate, acceptance by depth, context length, MTP's
    # draft/verify split) for the flight recorder; not part of the API's mtplx_stats (see
    # generation.DecodeSamples).
    samples: list[dict] = field(default_factory=list)
    # Decode cycles by the width of the cohort whose batched verify the row ran in ({"3": 12});
    # empty when the row decoded alone (not through the scheduler's cohorts).
    cohort_widths: dict[str, int] = field(default_factory=dict)
    # The runaway-loop guard ended the output (finish_reason "length"): the loop's period and
    # the repeated tokens trimmed from the output (never sent).
    repetition_stop: bool = False
    repetition_period: int = 0
    repetition_trimmed_tokens: int = 0

    def to_dict(self) -> dict:
        """A JSON-ready copy."""
        return asdict(self)


@dataclass
class GenerationResult:
    """The last item a generation yields."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "cancelled"
    stats: GenerationStats


@dataclass
class ModelInfo:
    """What is loaded and how it will be served."""

    id: str
    path: str
    family: str
    mode: str  # "mtp" | "ar"
    ar_reason: str | None
    depth: int
    context_length: int
    quantization: str | None
    vocab_size: int
    weights_bytes: int
    decode_loop: str = "stepwise"  # the loop MTP requests run: "fused" | "stepwise"
    dtype: str = "bfloat16"  # what it computes (and caches) in; float32 on the Linux CPU
    vision: bool = False  # images in the prompt are served (a vision tower is loaded)
    vision_reason: str | None = None  # why a checkpoint with vision_config is served text-only
    # Which implementation each fast path runs here (loaded_model.kernel_paths): a custom
    # kernel, or MLX's own ops where the kernel is missing, off or failed its probe.
    kernels: dict[str, str] = field(default_factory=dict)
    kv_bits: int = 0  # attention KV cache quantization (0 = full precision)
    # Why an MTP model's default depth is 0 on this backend (loader.default_depth), when it is.
    depth_reason: str | None = None

    def to_dict(self) -> dict:
        """A JSON-ready copy."""
        return asdict(self)


@dataclass
class CheckpointReport:
    """What a checkpoint folder is, read from config.json and safetensors headers only."""

    path: str
    model_type: str
    family: str | None  # registry family, or None when served AR
    mode: str  # "mtp" | "ar" | "refused"
    reason: str | None  # why AR / why refused
    quantization: str | None
    has_mtp_tensors: bool
    weights_bytes: int
    context_length: int | None
    vision: bool = False  # config.json has a vision tower that mtplx serves
    vision_reason: str | None = None  # why a vision_config is not served (text only)

    def to_dict(self) -> dict:
        """A JSON-ready copy."""
        return asdict(self)
