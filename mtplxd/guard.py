"""The memory guard: price every request before prefill, and refuse what would not fit.

A request costs most at its largest moment: the KV cache for prompt + max output (rounded up to
the cache's allocation step), the per-sequence recurrent state of Gated DeltaNet layers, the MTP
head's own KV, and the activations of one prefill chunk. Weights are already resident. Over the
limit, the guard first asks the session bank to release idle entries, then tries smaller
prefill chunks, then refuses with a structured InsufficientMemory that the API renders as 507.

Pure accounting (no MLX, no trio): the daemon applies the limit to MLX and runs the pressure loop.
"""

from __future__ import annotations

import math
import platform
import sys
import threading
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

GIB = 1024**3
# mlx-lm's KVCache grows its buffers in steps of 256 tokens.
KV_ALLOCATION_STEP = 256
DEFAULT_PREFILL_CHUNK = 512
SMALLEST_PREFILL_CHUNK = 64
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


class InsufficientMemory(Exception):
    """A request does not fit; the fields say by how much and what holds memory."""

    def __init__(self, needed_bytes: int, available_bytes: int, holders: dict[str, int],
                 limit_bytes: int, hint: str, reason: str = "") -> None:
        # `reason` leads the message when there is more to say than bytes (a long prompt).
        super().__init__(f"{reason}request needs {needed_bytes / GIB:.2f} GiB but only "
                         f"{max(available_bytes, 0) / GIB:.2f} GiB is available under the "
                         f"{limit_bytes / GIB:.2f} GiB memory limit")
        self.needed_bytes = needed_bytes
        self.available_bytes = max(available_bytes, 0)
        self.holders = holders
        self.limit_bytes = limit_bytes
        self.hint = hint

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": "insufficient_memory",
            "message": str(self),
            "needed_bytes": self.needed_bytes,
            "available_bytes": self.available_bytes,
            "limit_bytes": self.limit_bytes,
            "held_by": self.holders,
            "hint": self.hint,
        }


@dataclass(frozen=True)
class MemoryPlan:
    """What one model costs, from its own geometry (config.json)."""

    weights_bytes: int
    kv_bytes_per_token: int            # all full-attention layers of the trunk
    mtp_kv_bytes_per_token: int        # the MTP head's attention layer(s)
    recurrent_bytes_per_sequence: int  # Gated DeltaNet conv + recurrent state, all GDN layers
    activation_bytes_per_prefill_token: int
    attention_layers: int
    recurrent_layers: int
    dtype_bytes: int
    context_length: int

    def kv_tokens(self, tokens: int) -> int:
        """Tokens the KV buffers hold for `tokens`, at the cache's allocation granularity."""
        return math.ceil(max(tokens, 1) / KV_ALLOCATION_STEP) * KV_ALLOCATION_STEP

    def kv_bytes(self, tokens: int) -> int:
        """The attention KV (trunk and MTP head) a request of `tokens` (prompt + max output)
        is priced for."""
        return self.kv_tokens(tokens) * (self.kv_bytes_per_token + self.mtp_kv_bytes_per_token)

    def request_bytes(self, prompt_tokens: int, max_tokens: int, prefill_chunk: int) -> int:
        """A request's peak bytes beyond the resident weights."""
        kv = self.kv_bytes(prompt_tokens + max_tokens)
        chunk = min(prefill_chunk, max(prompt_tokens, 1))
        return kv + self.recurrent_bytes_per_sequence + chunk * self.activation_bytes_per_prefill_token

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def verify_state_bytes(plan: MemoryPlan, depth: int, gdn_verify: str | None) -> int:
    """What a hybrid's verify holds beyond its own state when it runs on the every-row GDN
    kernel (`gdn_verify` "CUDA kernel", engine/model/gdn_kernel.verify_rows): each of its
    depth + 1 rows keeps a whole recurrent state until the accept decides (576 MB at depth 3
    for a 27B hybrid). Priced as depth + 1 sequences' recurrent state; 0 otherwise."""
    if gdn_verify != "CUDA kernel" or depth <= 0:
        return 0
    return (depth + 1) * plan.recurrent_bytes_per_sequence


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """VLM-style checkpoints nest the language model's keys under text_config."""
    return {**config, **(config.get("text_config") or {})}


def _dtype_bytes(config: dict[str, Any]) -> int:
    # Quantized checkpoints still compute (and cache) in their float dtype.
    name = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16").replace("torch.", "")
    return DTYPE_BYTES.get(name, 2)


def _layer_kinds(config: dict[str, Any]) -> tuple[int, int]:
    """(full-attention layers, Gated DeltaNet layers) of the trunk."""
    layers = int(config["num_hidden_layers"])
    if "layer_types" in config:
        linear = sum(1 for kind in config["layer_types"] if kind == "linear_attention")
        return layers - linear, linear
    interval = config.get("full_attention_interval")
    if interval and "linear_num_value_heads" in config:
        attention = sum(1 for i in range(layers) if (i + 1) % int(interval) == 0)
        return attention, layers - attention
    return layers, 0


def plan_for_config(config: dict[str, Any], weights_bytes: int,
                    dtype: str | None = None, kv_bits: int = 0) -> MemoryPlan:
    """Compute the MemoryPlan of a model from its config.json and its resident weights' size.

    `dtype` is what the loaded model computes in when it differs from the checkpoint's (the
    Linux CPU upcasts to float32): its KV cache and activations are that wide too. With
    `kv_bits` (8 or 4) the attention KV is priced as stored quantized: `kv_bits` per element
    plus a scale and a bias (model dtype) per group of 64 (32 when the head needs it).
    """
    text = _text_config(config)
    dtype = DTYPE_BYTES.get(dtype, 2) if dtype else _dtype_bytes(text)
    hidden = int(text["hidden_size"])
    heads = int(text["num_attention_heads"])
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or hidden // heads)
    attention_layers, recurrent_layers = _layer_kinds(text)
    per_layer_kv = kv_heads * head_dim * 2 * dtype  # keys and values
    if kv_bits:
        group = 64 if head_dim % 64 == 0 else 32
        per_layer_kv = int(kv_heads * head_dim * 2 * (kv_bits / 8 + 2 * dtype / group))
    mtp_layers = int(text.get("mtp_num_hidden_layers") or text.get("num_nextn_predict_layers") or 0)
    recurrent = 0
    if recurrent_layers:
        hk, hv = int(text["linear_num_key_heads"]), int(text["linear_num_value_heads"])
        dk, dv = int(text["linear_key_head_dim"]), int(text["linear_value_head_dim"])
        conv_dim = 2 * hk * dk + hv * dv
        kernel = int(text.get("linear_conv_kernel_dim", 4))
        state = hv * dv * dk * 4  # the recurrent state stays float32 whatever the model dtype
        recurrent = recurrent_layers * (state + (kernel - 1) * conv_dim * dtype)
    intermediate = int(text.get("intermediate_size") or text.get("moe_intermediate_size") or 4 * hidden)
    # One layer's live activations per prefill token (hidden in/out, q/k/v, MLP gate+up), plus
    # the float32 attention scores of a chunk row against itself are bounded by the chunk.
    activation = (4 * hidden + (heads + 2 * kv_heads) * head_dim + 2 * intermediate) * dtype
    return MemoryPlan(
        weights_bytes=int(weights_bytes),
        kv_bytes_per_token=attention_layers * per_layer_kv,
        mtp_kv_bytes_per_token=mtp_layers * per_layer_kv,
        recurrent_bytes_per_sequence=recurrent,
        activation_bytes_per_prefill_token=activation,
        attention_layers=attention_layers,
        recurrent_layers=recurrent_layers,
        dtype_bytes=dtype,
        context_length=int(text.get("max_position_embeddings") or 0),
    )


def os_reserve_bytes(total: int) -> int:
    """Memory left to the OS and other apps under `memory_limit = max`."""
    return max(2 * GIB, total // 10)


def is_unified_memory() -> bool:
    return sys.platform == "darwin" and platform.machine() == "arm64"


def resolve_limit(setting: str | float, total_bytes: int) -> int:
    """The byte limit for a `memory_limit` setting: auto, max, or GiB."""
    if setting == "max":
        return total_bytes - os_reserve_bytes(total_bytes)
    if setting == "auto":
        # Unified memory is shared with the GPU and the desktop: keep a quarter back. A Linux box
        # serving from CPU RAM keeps a fifth back for the rest of the system.
        fraction = 0.75 if is_unified_memory() else 0.8
        return int(total_bytes * fraction)
    return min(int(float(setting) * GIB), total_bytes)


@dataclass(frozen=True)
class ContextWindow:
    """The model's own context and what this server serves of it under its memory limit."""

    model: int  # the model's maximum (0: the checkpoint does not say)
    memory: int | None  # prompt + output that fit under the memory limit (None: no guard)

    @property
    def served(self) -> int:
        """The window clients are told: the smaller of the two; 0 when memory fits nothing
        (never an unbounded value in its place)."""
        if self.memory is None:
            return self.model
        return min(self.model, self.memory) if self.model else self.memory

    @property
    def limited_by(self) -> str:
        """"memory" when the memory limit, not the model, sets the served window."""
        if self.memory is None:
            return "model"
        return "memory" if not self.model or self.memory < self.model else "model"

    def to_dict(self) -> dict[str, Any]:
        return {"context_length": self.served, "model_context_length": self.model,
                "context_limited_by": self.limited_by}


def context_window(model_context: int, guard: "MemoryGuard | None") -> ContextWindow:
    """The context window of a loaded model under `guard` (None: no memory guard)."""
    return ContextWindow(int(model_context or 0),
                         guard.max_context_tokens() if guard is not None else None)


@dataclass
class Reservation:
    """Memory held by one admitted request until release()."""

    id: int
    bytes: int
    prefill_chunk: int
    guard: "MemoryGuard" = field(repr=False)

    def release(self) -> None:
        self.guard._release(self)


class MemoryGuard:
    """Admission control over one model's plan and one byte limit (thread-safe)."""

    def __init__(self, plan: MemoryPlan, limit_bytes: int,
                 bank_bytes: Callable[[], int] = lambda: 0,
                 release_bank: Callable[[int], int] = lambda needed: 0,
                 system_available: Callable[[], int] | None = None, serial: bool = True) -> None:
        self.plan = plan
        # serial=True: requests run one after another, so reservations do not stack. The
        # daemon's scheduler runs rows side by side (serial=False): each request is priced
        # next to the running rows' holds, and `try_admit` tells "wait" from "never".
        self.serial = serial
        self.limit_bytes = limit_bytes
        self._bank_bytes = bank_bytes
        self._release_bank = release_bank
        self._system_available = system_available
        self._lock = threading.Lock()
        self._held: dict[int, Reservation] = {}
        # Fused cohorts' KV buffers beyond their rows' reservations, by cohort: hold_cohort.
        self._cohort_padding: dict[Any, int] = {}
        self._next_id = 0
        self.refused = 0
        self.bank_releases = 0

    def held_bytes(self) -> int:
        """Bytes reserved by running requests: their own reservations and the padding of the
        fused cohorts they run in."""
        return self.reserved_bytes() + self.cohort_padding_bytes()

    def reserved_bytes(self) -> int:
        """Bytes of the running requests' own reservations (each priced by its own length)."""
        return sum(r.bytes for r in self._held.values())

    def cohort_padding_bytes(self) -> int:
        """Bytes fused cohorts' KV buffers hold beyond what their rows' reservations price."""
        return sum(self._cohort_padding.values())

    def available_bytes(self, alone: bool = False) -> int:
        """What a new request may use at its turn: the limit less weights and the session bank
        (less running requests too, unless serial or `alone`: as if none ran), and never more
        than the OS can give."""
        if alone and not self.serial:
            return self.available_bytes() + self.held_bytes()
        stacked = 0 if self.serial else self.held_bytes()
        under_limit = self.limit_bytes - self.plan.weights_bytes - stacked - self._bank_bytes()
        if self._system_available is not None:
            # Memory a running request holds now comes back before a serial successor starts.
            returning = self.held_bytes() if self.serial else 0
            return min(under_limit, self._system_available() + returning)
        return under_limit

    def holders(self) -> dict[str, int]:
        return {"weights": self.plan.weights_bytes, "running_requests": self.reserved_bytes(),
                "cohort_padding": self.cohort_padding_bytes(), "session_bank": self._bank_bytes()}

    def admit(self, prompt_tokens: int, max_tokens: int,
              prefill_chunk: int = DEFAULT_PREFILL_CHUNK, extra_bytes: int = 0) -> Reservation:
        """Reserve memory for a request before its prefill, or raise InsufficientMemory.

        Order of remedies: release idle session-bank entries, then smaller prefill chunks
        (never larger than `prefill_chunk`). `extra_bytes`: what the request needs beyond its
        tokens (its images' pixels and vision-tower activations).
        """
        with self._lock:
            try:
                return self._admit(prompt_tokens, max_tokens, prefill_chunk, extra_bytes)
            except InsufficientMemory:
                self.refused += 1
                raise

    def try_admit(self, prompt_tokens: int, max_tokens: int,
                  prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                  extra_bytes: int = 0) -> Reservation | None:
        """`admit` for a queue: None when the request does not fit beside the running ones but
        would once they leave (it waits); InsufficientMemory when it would not fit even then."""
        with self._lock:
            try:
                return self._admit(prompt_tokens, max_tokens, prefill_chunk, extra_bytes)
            except InsufficientMemory as refused:
                if self.held_bytes() and refused.needed_bytes <= self.available_bytes(alone=True):
                    return None  # not refused: it waits its turn
                self.refused += 1
                raise

    def check(self, prompt_tokens: int, max_tokens: int, extra_bytes: int = 0) -> None:
        """Raise InsufficientMemory when the request could not fit even with nothing else
        running (checked at arrival, so a hopeless request is refused before it queues)."""
        with self._lock:
            needed = self.plan.request_bytes(prompt_tokens, max_tokens, SMALLEST_PREFILL_CHUNK) \
                + extra_bytes
            available = self.available_bytes(alone=True)
            if needed > available and self._bank_bytes() > 0:
                self.release_bank(needed - available)
                available = self.available_bytes(alone=True)
            if needed > available:
                self.refused += 1
                raise InsufficientMemory(needed, available, self.holders(),
                                         self.limit_bytes, self._hint(prompt_tokens, max_tokens))

    def _admit(self, prompt_tokens: int, max_tokens: int, prefill_chunk: int,
               extra_bytes: int = 0) -> Reservation:
        chunk = max(prefill_chunk, SMALLEST_PREFILL_CHUNK)
        needed = self.plan.request_bytes(prompt_tokens, max_tokens, chunk) + extra_bytes
        if needed > self.available_bytes() and self._bank_bytes() > 0:
            self.release_bank(needed - self.available_bytes())
        while needed > self.available_bytes() and chunk > SMALLEST_PREFILL_CHUNK:
            chunk = max(chunk // 2, SMALLEST_PREFILL_CHUNK)
            needed = self.plan.request_bytes(prompt_tokens, max_tokens, chunk) + extra_bytes
        if needed > self.available_bytes():  # the callers count the refusal (or the wait)
            raise InsufficientMemory(needed, self.available_bytes(), self.holders(),
                                     self.limit_bytes, self._hint(prompt_tokens, max_tokens))
        self._next_id += 1
        reservation = Reservation(self._next_id, needed, chunk, self)
        self._held[reservation.id] = reservation
        return reservation

    def hold_cohort(self, key: Any, buffer_bytes: int, ceilings: list[int],
                    must: bool = False) -> bool:
        """Hold what a fused cohort's KV buffers (`buffer_bytes` at the most they may grow to)
        reach beyond its rows' reservations (each priced for its own `ceilings`: prompt + max
        output), in place of the cohort's previous hold. False, and nothing changed, when the
        growth does not fit; `must`: hold it anyway (the memory is, or will be, allocated
        whatever the answer: a lone row, or a row leaving a cohort whose buffers stay)."""
        padding = max(buffer_bytes - sum(self.plan.kv_bytes(t) for t in ceilings), 0)
        with self._lock:
            growth = padding - self._cohort_padding.get(key, 0)
            if not must and growth > self.available_bytes() and self._bank_bytes() > 0:
                self.release_bank(growth - self.available_bytes())  # as an admission would
            if not must and growth > 0 and growth > self.available_bytes():
                return False
            self._cohort_padding[key] = padding
            return True

    def free_cohort(self, key: Any) -> None:
        """The cohort has no row left: its buffers are gone, and so is its hold."""
        with self._lock:
            self._cohort_padding.pop(key, None)

    def release_bank(self, needed: int) -> int:
        """Ask the session bank to free `needed` bytes of idle entries; returns bytes freed."""
        freed = self._release_bank(needed)
        if freed > 0:
            self.bank_releases += 1
        return freed

    def _release(self, reservation: Reservation) -> None:
        with self._lock:
            self._held.pop(reservation.id, None)

    def _hint(self, prompt_tokens: int, max_tokens: int) -> str:
        fits = self.max_context_tokens()
        return (f"lower max_tokens or shorten the prompt (this model fits about {fits} tokens of "
                f"prompt + output now), wait for running requests to finish, or raise "
                f"memory_limit (`mtplxctl config set memory_limit max`)")

    def refuse_prompt(self, prompt_tokens: int, window: "ContextWindow") -> InsufficientMemory:
        """The 507 for a prompt that the model's context holds but memory does not: priced
        at its smallest (one output token, the smallest prefill chunk), counted as refused."""
        with self._lock:
            self.refused += 1
            needed = self.plan.request_bytes(prompt_tokens, 1, SMALLEST_PREFILL_CHUNK)
            reason = (f"the memory limit caps this server's context at {window.served} tokens "
                      f"(the model's is {window.model}) and the prompt is {prompt_tokens} "
                      f"tokens: ")
            return InsufficientMemory(needed, self.available_bytes(), self.holders(),
                                      self.limit_bytes, self._hint(prompt_tokens, 1), reason)

    def max_context_tokens(self) -> int:
        """The longest prompt + output one request can have with nothing else running."""
        budget = self.limit_bytes - self.plan.weights_bytes - self.plan.recurrent_bytes_per_sequence \
            - SMALLEST_PREFILL_CHUNK * self.plan.activation_bytes_per_prefill_token
        per_token = self.plan.kv_bytes_per_token + self.plan.mtp_kv_bytes_per_token
        if budget <= 0:
            return 0
        tokens = budget // per_token if per_token else self.plan.context_length
        tokens = tokens // KV_ALLOCATION_STEP * KV_ALLOCATION_STEP
        return int(min(tokens, self.plan.context_length or tokens))

    def status(self) -> dict[str, Any]:
        return {
            "limit_bytes": self.limit_bytes,
            "available_bytes": max(self.available_bytes(), 0),
            "held_by": self.holders(),
            "running": len(self._held),
            "refused": self.refused,
            "bank_releases": self.bank_releases,
            "max_context_tokens": self.max_context_tokens(),
            "plan": self.plan.to_dict(),
        }
