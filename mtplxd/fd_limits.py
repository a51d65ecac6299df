"""The daemon's open-file limit: as high as the machine lets it be, and never lowered by mlx-lm.

Why: every HTTP connection, control connection, model file and log is a descriptor. Importing
`mlx_lm.utils` sets RLIMIT_NOFILE to (2048, 4096) unconditionally, which on Linux lowers the
hard limit too (commonly 524,288 or more; a process without privileges can never raise it back),
so ~2,000 idle connections were enough to exhaust the daemon's descriptors; and where the hard
limit is under 4096 and the process may not raise it, the import raised ValueError and nothing
that imports the engine started at all. The engine's gateway (`mtplxd.engine`) calls
`activate()`, which imports mlx_lm.utils with setrlimit only ever raising a limit (on macOS,
a soft limit of 256, mlx-lm's 2048 still applies); once imported, its call never runs again.
The daemon then raises its soft limit to the hard one (`raise_soft_limit`), as Go's runtime
and most servers do.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import resource
from typing import Iterator

log = logging.getLogger(__name__)

NOFILE = resource.RLIMIT_NOFILE
# The most descriptors asked for: above it a process gains nothing, and macOS refuses a soft
# limit past kern.maxfilesperproc (setrlimit fails, and the next lower candidate is tried).
SOFT_CANDIDATES = (65536, 10240, 4096)


def activate() -> None:
    """Import mlx_lm.utils (its import sets the limit) without it lowering either limit."""
    with never_lowered():
        importlib.import_module("mlx_lm.utils")


def raise_soft_limit() -> int:
    """The soft limit raised as far as the hard limit and SOFT_CANDIDATES allow (never lowered)."""
    soft, hard = resource.getrlimit(NOFILE)
    for wanted in SOFT_CANDIDATES:
        if hard != resource.RLIM_INFINITY:
            wanted = min(wanted, hard)
        if _at_least(soft, wanted):
            break
        try:
            resource.setrlimit(NOFILE, (wanted, hard))
            break
        except (ValueError, OSError):
            continue
    return resource.getrlimit(NOFILE)[0]


def _at_least(limit: int, wanted: int) -> bool:
    return limit == resource.RLIM_INFINITY or limit >= wanted


def _smaller(a: int, b: int) -> int:
    if a == resource.RLIM_INFINITY:
        return b
    return a if b == resource.RLIM_INFINITY else min(a, b)


def _larger(a: int, b: int) -> int:
    return resource.RLIM_INFINITY if resource.RLIM_INFINITY in (a, b) else max(a, b)


@contextlib.contextmanager
def never_lowered() -> Iterator[None]:
    """Inside, `resource.setrlimit(RLIMIT_NOFILE, ...)` keeps each of the two limits at the
    larger of what it is and what is asked (a raise the process may not make is skipped)."""
    original = resource.setrlimit

    def setrlimit(which: int, limits: tuple[int, int]) -> None:
        if which != NOFILE:
            original(which, limits)
            return
        current = resource.getrlimit(NOFILE)
        wanted = (_larger(current[0], limits[0]), _larger(current[1], limits[1]))
        wanted = (_smaller(wanted[0], wanted[1]), wanted[1])
        # Failing the raise of the hard limit (no privilege), raise the soft one alone.
        for attempt in (wanted, (_smaller(wanted[0], current[1]), current[1])):
            if attempt == current:
                return
            try:
                original(NOFILE, attempt)
                return
            except (ValueError, OSError) as exc:
                log.debug("open-file limit %s not set to %s (%s)", current, attempt, exc)

    resource.setrlimit = setrlimit
    try:
        yield
    finally:
        resource.setrlimit = original
