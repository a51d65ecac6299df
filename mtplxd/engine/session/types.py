"""The session bank's data types, shared by the RAM tier (`bank`) and the SSD tier (`store`):
a stored entry, the layer kinds, and the rule that says where a prompt may resume from one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

ANONYMOUS = ""  # the session id of a request that names none

KV, GDN = "kv", "gdn"
# A quantized attention layer (kv_bits): its keys and values are each (data, scales, biases).
QKV = "qkv"
ATTENTION = (KV, QKV)


def layer_arrays(pair: tuple) -> list[mx.array]:
    """The arrays of one layer's (keys, values): two arrays, or two triples when quantized."""
    return [a for side in pair for a in (side if isinstance(side, tuple) else (side,))]

GDNState = list[tuple[mx.array, mx.array]]  # (conv, recurrent) per GDN layer, in layer order


@dataclass
class BankEntry:
    """The committed state over `tokens` (see the module docstring for what each field is)."""

    tokens: tuple[int, ...]
    kinds: tuple[str, ...]  # per trunk layer: KV, QKV or GDN
    # per trunk layer: (keys, values) as (1, H, S, D) arrays, or for QKV as (data, scales,
    # biases) triples of (1, H, S, D') arrays; None for GDN layers
    kv: list[tuple[Any, Any] | None]
    boundaries: dict[int, GDNState]  # hybrid only: token count -> state after that many
    head_kv: tuple[mx.array, mx.array] | None = None  # (1, H, head_len, D)
    head_len: int = 0
    tail_hidden: mx.array | None = None  # (1, S - head_len, H) trunk hiddens, or None
    # A prompt with images (mRoPE): token i >= S continues at 1-D position i + rope_delta.
    rope_delta: int = 0
    session_id: str = ANONYMOUS
    last_used: float = 0.0
    hits: int = 0
    nbytes: int = 0
    on_ssd: bool = False

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def hybrid(self) -> bool:
        return GDN in self.kinds

    @property
    def dtype(self) -> str | None:
        """The float dtype the entry's state was computed in ("float32", ...), from its first
        KV (or head KV, or conv state) array; None when it holds none."""
        for pair in [*self.kv, self.head_kv]:
            if pair is not None:
                # A quantized layer's scales carry the compute dtype (its data is packed uint32).
                return _dtype_name(pair[0][1] if isinstance(pair[0], tuple) else pair[0])
        for state in self.boundaries.values():
            for conv, _ in state:
                if conv is not None:
                    return _dtype_name(conv)
        return None

    def arrays(self) -> list[mx.array]:
        """Every array the entry holds (for eval and byte accounting)."""
        out: list[mx.array] = []
        for pair in self.kv:
            if pair is not None:
                out.extend(layer_arrays(pair))
        for state in self.boundaries.values():
            for conv, rec in state:
                out.extend(a for a in (conv, rec) if a is not None)
        if self.head_kv is not None:
            out.extend(self.head_kv)
        if self.tail_hidden is not None:
            out.append(self.tail_hidden)
        return out

    def compute_nbytes(self) -> int:
        self.nbytes = sum(a.nbytes for a in self.arrays()) + 8 * self.length
        return self.nbytes


def _dtype_name(array: mx.array) -> str:
    return str(array.dtype).rsplit(".", 1)[-1]


def common_prefix(a: tuple[int, ...] | list[int], b: list[int] | np.ndarray) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.asarray(a[:n], dtype=np.int64)
    y = np.asarray(b[:n], dtype=np.int64)
    diff = np.nonzero(x != y)[0]
    return int(diff[0]) if diff.size else n


@dataclass(frozen=True)
class RestorePlan:
    """Where a request resumes: trunk at `trunk_len` tokens, head at `head_len` pairs."""

    trunk_len: int
    head_len: int


def plan_restore(length: int, boundaries: list[int] | None, head_len: int, tail_rows: int,
                 matched: int, prompt_len: int, need_head: bool) -> RestorePlan | None:
    """The deepest exact restore of a stored state for a prompt, or None.

    `length`: tokens the entry covers; `boundaries`: allowed trunk lengths for a hybrid
    entry (None: any length, dense); `head_len`/`tail_rows`: the head's pairs and the kept
    hiddens after them; `matched`: common prefix of entry and prompt. At least one prompt
    token is always left to prefill (its logits pick the first output token).
    """
    limit = min(matched, prompt_len - 1, length)
    if limit <= 0:
        return None
    if boundaries is None:
        candidates = [limit]
    else:
        candidates = sorted((b for b in boundaries if 0 < b <= limit), reverse=True)
    for r in candidates:
        if not need_head:
            return RestorePlan(r, 0)
        # Head pair j is (h_j, x_{j+1}): pair r-1 is valid only if x_r matched too.
        p = min(head_len, r, matched - 1)
        if p == r or (p == head_len and head_len + tail_rows >= r):
            return RestorePlan(r, p) if r > 0 else None
        if boundaries is None and p > 0:
            return RestorePlan(p, p)
    return None
