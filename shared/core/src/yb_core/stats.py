"""Summary statistics shared by the services and the tools."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The `q`-th percentile (0..100) of a non-empty sequence, interpolated linearly
    between closest ranks (numpy's default). The gateway's SLO verdict and `yb bench`
    judge a request's inter-token gaps with it, so both agree on what met the SLO."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be within 0..100, got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
