"""Image bytes for vision tests: random pixels, so two seeds are two different images."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def png(seed: int, width: int = 64, height: int | None = None) -> bytes:
    """A PNG of random RGB pixels, `width` x `height` (square when height is None)."""
    shape = (height or width, width, 3)
    pixels = (np.random.default_rng(seed).random(shape) * 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()
