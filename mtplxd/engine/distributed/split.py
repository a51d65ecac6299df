"""Which layers each rank holds: contiguous slices in proportion to each rank's free memory.

Rank 0 also holds the embeddings, the final norm, lm_head and the MTP head, so its budget for
layers is its free memory less those; every rank keeps at least one layer.
"""

from __future__ import annotations


def split_layers(num_layers: int, budgets: list[float]) -> list[tuple[int, int]]:
    """[(start, end)) per rank, contiguous and in rank order, sized in proportion to `budgets`
    (bytes each rank can give to layers). Every rank gets at least one layer."""
    ranks = len(budgets)
    if ranks > num_layers:
        raise ValueError(f"{ranks} ranks but only {num_layers} layers: every rank needs one")
    weights = [max(float(b), 0.0) for b in budgets]
    if not sum(weights):
        weights = [1.0] * ranks
    total = sum(weights)
    counts = [max(1, int(num_layers * w / total)) for w in weights]
    # Hand out what rounding left (or take back what the minimum of one added) by largest share.
    order = sorted(range(ranks), key=lambda r: weights[r], reverse=True)
    i = 0
    while sum(counts) < num_layers:
        counts[order[i % ranks]] += 1
        i += 1
    while sum(counts) > num_layers:
        r = next(r for r in order if counts[r] > 1)
        counts[r] -= 1
    bounds, start = [], 0
    for count in counts:
        bounds.append((start, start + count))
        start += count
    return bounds


def parse_split(text: str, num_layers: int) -> list[tuple[int, int]]:
    """A split given as layer counts, "4,4,8", checked against the model's layer count."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"a split is layer counts separated by commas, got {text!r}") from None
    if any(c <= 0 for c in counts) or sum(counts) != num_layers:
        raise ValueError(f"split {text!r} must be positive counts that sum to {num_layers} layers")
    bounds, start = [], 0
    for count in counts:
        bounds.append((start, start + count))
        start += count
    return bounds
