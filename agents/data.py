"""Comparing plain config data (what a parser reads from a file) as equal or not."""

from __future__ import annotations

import math
from typing import Any


def same_data(a: Any, b: Any) -> bool:
    """True when `a` and `b` hold the same data; unlike `==`, a NaN equals a NaN.

    TOML and YAML can spell NaN (`nan`, `.nan`), and a file that holds one must still read
    as itself after an edit.
    """
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_data(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_data(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b if isinstance(a, (bool, int, float)) else a == b
