"""What every custom CUDA kernel of the engine shares: it is used only after a probe on
this machine compiled it and matched MLX's own ops, and any failure leaves MLX's ops in place.
"""

from __future__ import annotations

import logging
from typing import Callable

log = logging.getLogger(__name__)


def probe(name: str, error: Callable[[], float], limit: float, fallback: str) -> bool:
    """True when `error()` runs (compiling and launching the kernel) and stays below `limit`;
    otherwise log why and return False, so the caller keeps `fallback`."""
    try:
        measured = error()
    except Exception as exc:  # noqa: BLE001 - any JIT or launch failure means "not here"
        log.warning("%s kernel unavailable, using %s: %s", name, fallback, exc)
        return False
    if not measured < limit:
        log.warning("%s kernel disagrees with %s (error %s); not using it", name, fallback, measured)
        return False
    return True
