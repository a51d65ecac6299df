"""A KV cache whose attention shapes change every 256 tokens instead of every token.

mlx-lm's KVCache hands attention `keys[..., :offset, :]`, so the key length of every forward
is new. On MLX's CUDA backend a multi-row attention (a verify) is built per shape, and a
fresh key length per cycle made a 2-token verify 10x slower than one at a constant length.
BucketedKVCache hands attention the whole preallocated buffer (grown 256 slots at a time)
and hides the slots past the offset with a boolean mask, so a verify of K+1 rows meets one
shape per 256 tokens of context. Masked slots get exactly zero weight.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache


class BucketedKVCache(KVCache):
    """KVCache that exposes its whole 256-step buffer to multi-token forwards, masked past
    the offset. Single-token forwards (AR steps, chained drafts) keep mlx-lm's exact-length
    keys and no mask: their attention kernel takes any length without a rebuild, and a
    masked full-buffer attention measured 2x slower for them on the H200."""

    _padded = False  # whether the last update_and_fetch handed out the whole buffer

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store the new keys/values; return the whole buffer for n > 1, else the prefix."""
        self._padded = keys.shape[2] > 1
        return super().update_and_fetch(keys, values)

    def _size_after(self, n: int) -> int:
        """The buffer length after `update_and_fetch` of n more tokens (KVCache's growth rule)."""
        size = 0 if self.keys is None else self.keys.shape[2]
        if self.keys is None or self.offset + n > size:
            kept = self.offset if (self.keys is not None and self.offset % self.step) else size
            return kept + ((self.step + n - 1) // self.step) * self.step
        return size

    def make_mask(self, n: int, return_array: bool = False,
                  window_size: int | None = None) -> mx.array | None:
        """(n, buffer) boolean mask: query i sees slots 0..offset+i (causal, padding hidden);
        None for a single token, which attends to exactly the keys it is given."""
        if window_size is not None:
            raise ValueError("BucketedKVCache does not support sliding-window attention")
        if n == 1 and not return_array:
            return None
        slots = mx.arange(self._size_after(n))[None]
        queries = mx.arange(self.offset, self.offset + n)[:, None]
        return slots <= queries

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        """The whole buffer after a multi-token update (make_mask hides the unused slots)."""
        if self._padded:
            return self.keys, self.values
        return super().keys_and_values()


def bucket_kv_caches(cache: list[Any]) -> list[Any]:
    """Replace every plain KVCache in a cache list by a BucketedKVCache (others unchanged)."""
    return [BucketedKVCache() if type(entry) is KVCache and entry.keys is None else entry
            for entry in cache]


def fixed_shapes_wanted() -> bool:
    """True on backends that build kernels per shape (CUDA); False on CPU and Metal."""
    cuda = getattr(mx, "cuda", None)
    try:
        return bool(cuda is not None and cuda.is_available())
    except Exception:  # an MLX build without the CUDA module
        return False



KV_BITS_CHOICES = (0, 4, 8)  # 0 = full precision


def kv_group_size(head_dim: int) -> int:
    """The quantization group for a head dimension (MLX quantizes in groups of 32, 64 or 128
    along the last axis): 64 when it divides, else 32; 0 when neither does."""
    for size in (64, 32):
        if head_dim % size == 0:
            return size
    return 0


def quantize_kv_caches(cache: list[Any], bits: int, group_size: int) -> list[Any]:
    """Replace every plain KVCache (bucketed included) in a cache list by mlx-lm's
    QuantizedKVCache (others, e.g. Gated DeltaNet state, unchanged). mlx-lm's attention reads
    a quantized cache with quantized matmuls, and its `trim(n)` rolls it back as the
    speculative loop needs."""
    from mlx_lm.models.cache import QuantizedKVCache

    return [QuantizedKVCache(group_size=group_size, bits=bits) if isinstance(entry, KVCache) else entry
            for entry in cache]
