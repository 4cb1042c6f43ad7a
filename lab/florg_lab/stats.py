"""Statistics for seeded comparisons: t intervals of a mean and of paired differences.

Runs of different methods that share a seed share the data subset, the partition and the
client sampling (a paired design), so method A is compared with method B through the
per-seed differences d_s = A_s - B_s: their mean, its 95% t interval
mean ± t_{0.975, n-1} · sd / √n, and the win count (seeds where A scored higher).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

try:
    from scipy.stats import t as student_t
except ModuleNotFoundError as err:  # the tooling's extra, not a runtime dependency
    raise ModuleNotFoundError("the experiment statistics need scipy: pip install -e lab") from err

__all__ = ["Interval", "Paired", "mean_interval", "paired_difference", "verdict"]


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float  # nan with fewer than two values
    high: float
    n: int

    def __str__(self) -> str:
        if math.isnan(self.low):
            return f"{self.mean:.4f} (n = {self.n})"
        return f"{self.mean:.4f} [{self.low:.4f}, {self.high:.4f}]"


@dataclass(frozen=True)
class Paired:
    difference: Interval
    wins: int
    losses: int
    ties: int


def mean_interval(values: Sequence[float], level: float = 0.95) -> Interval:
    """Mean of ``values`` with its two-sided ``level`` Student-t confidence interval."""
    data = [float(v) for v in values]
    if not data:
        raise ValueError("no values")
    if any(math.isnan(v) for v in data):
        raise ValueError("values contain NaN")
    mean = statistics.fmean(data)
    if len(data) < 2:
        return Interval(mean, math.nan, math.nan, len(data))
    half = student_t.ppf(0.5 + level / 2, len(data) - 1) * statistics.stdev(data)
    half /= math.sqrt(len(data))
    return Interval(mean, mean - half, mean + half, len(data))


def paired_difference(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> Paired:
    """A − B over paired seeds (the same position in both lists is the same seed)."""
    if len(a) != len(b):
        raise ValueError(f"paired lists differ in length: {len(a)} vs {len(b)}")
    diffs = [float(x) - float(y) for x, y in zip(a, b, strict=True)]
    return Paired(
        mean_interval(diffs, level),
        wins=sum(d > 0 for d in diffs),
        losses=sum(d < 0 for d in diffs),
        ties=sum(d == 0 for d in diffs),
    )


def verdict(interval: Interval) -> str:
    """'holds' when the interval lies above 0, 'does not hold' when below, else
    'inconclusive' (also with too few values for an interval)."""
    if math.isnan(interval.low):
        return "inconclusive"
    if interval.low > 0:
        return "holds"
    if interval.high < 0:
        return "does not hold"
    return "inconclusive"
