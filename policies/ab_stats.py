"""Statistics of an A/B benchmark (docs/reference/benchmarking.md §1, §6 rule 7).

Pure: no clocks, no I/O; randomness only through the seeded `random.Random` the caller
passes (`Rng`), so a seeded run gives the same interval twice.

- `percentile` is numpy's default (linear interpolation between closest ranks), the one
  `vllm bench serve` reports.
- `coefficient_of_variation` uses the sample standard deviation (n − 1), as run-to-run CV
  is graded in the Red Hat guide the reference cites.
- `paired_bootstrap_ratio` resamples *blocks* with replacement, the same block indices for
  both arms (block i of A and block i of B ran side by side, so they share whatever the
  machine did then), and, inside every chosen block, the block's requests with replacement
  (a two-stage bootstrap: between-block and within-block variation both reach the
  interval). The interval is the percentile interval of the resampled B/A ratios.
- `kendall_trend` is Kendall's tau of a series against its order, with an exact two-sided
  permutation p-value for short series and the normal approximation beyond: a paired
  ratio that climbs block after block is drift, not a difference between engines.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

T = TypeVar("T")


class Rng(Protocol):
    """What the bootstrap draws with: a seeded `random.Random` passed by the caller."""

    def randrange(self, start: int, stop: int | None = ..., step: int = ...) -> int: ...

    def choices(self, population: Sequence[T], *, k: int) -> list[T]: ...


Statistic = Callable[[Sequence[float]], float]
EXACT_KENDALL_MAX_N = 20


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be within 0..100, got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50.0)


def mean(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("mean of no values")
    return math.fsum(values) / len(values)


@dataclass(frozen=True, slots=True)
class Summary:
    """Mean and percentiles of one sample, in the sample's unit."""

    count: int
    mean: float
    std: float
    p50: float
    p90: float
    p99: float


def summarize(values: Sequence[float]) -> Summary | None:
    """None for an empty sample (not measured), never zeros."""
    if not values:
        return None
    m = mean(values)
    std = math.sqrt(math.fsum((v - m) ** 2 for v in values) / len(values))  # np.std
    return Summary(len(values), m, std, percentile(values, 50), percentile(values, 90),
                   percentile(values, 99))


def coefficient_of_variation(values: Sequence[float]) -> float | None:
    """Sample std / mean; None with fewer than two values or a zero mean."""
    if len(values) < 2:
        return None
    m = mean(values)
    if m == 0:
        return None
    var = math.fsum((v - m) ** 2 for v in values) / (len(values) - 1)
    return math.sqrt(var) / abs(m)


@dataclass(frozen=True, slots=True)
class RatioInterval:
    """B/A (or B − A): the point estimate over all samples and the bootstrap interval."""

    estimate: float
    low: float
    high: float
    level: float
    resamples: int

    def contains(self, value: float) -> bool:
        return self.low <= value <= self.high

    def excludes_one(self) -> bool:
        return not self.contains(1.0)


def _resample_pooled(blocks: Sequence[Sequence[float]], picks: Sequence[int],
                     rng: Rng) -> list[float]:
    pooled: list[float] = []
    for i in picks:
        pooled.extend(rng.choices(blocks[i], k=len(blocks[i])))
    return pooled


def _paired_bootstrap(a_blocks: Sequence[Sequence[float]], b_blocks: Sequence[Sequence[float]],
                      statistic: Statistic, rng: Rng, resamples: int, level: float,
                      combine: Callable[[float, float], float | None]) -> RatioInterval | None:
    if len(a_blocks) != len(b_blocks):
        raise ValueError("paired blocks: both arms need the same number of blocks")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be within (0, 1), got {level}")
    if resamples < 100:
        raise ValueError("use at least 100 bootstrap resamples")
    pairs = [(a, b) for a, b in zip(a_blocks, b_blocks, strict=True) if a and b]
    if len(pairs) < 2:
        return None
    estimate = combine(statistic([v for a, _ in pairs for v in a]),
                       statistic([v for _, b in pairs for v in b]))
    if estimate is None:
        return None
    a_side, b_side = [a for a, _ in pairs], [b for _, b in pairs]
    draws = []
    for _ in range(resamples):
        picks = [rng.randrange(len(pairs)) for _ in range(len(pairs))]
        value = combine(statistic(_resample_pooled(a_side, picks, rng)),
                        statistic(_resample_pooled(b_side, picks, rng)))
        if value is not None:
            draws.append(value)
    if len(draws) < resamples // 2:
        return None
    tail = (1.0 - level) / 2.0 * 100.0
    return RatioInterval(estimate, percentile(draws, tail), percentile(draws, 100.0 - tail),
                         level, resamples)


def paired_bootstrap_ratio(
    a_blocks: Sequence[Sequence[float]],
    b_blocks: Sequence[Sequence[float]],
    statistic: Statistic,
    rng: Rng,
    resamples: int = 2000,
    level: float = 0.95,
) -> RatioInterval | None:
    """Interval of statistic(B) / statistic(A) by the two-stage paired bootstrap (module
    docstring). Block i of each arm is one pair; a pair with an empty side is dropped.
    None when fewer than two pairs remain or A's statistic is zero (no ratio exists)."""
    return _paired_bootstrap(a_blocks, b_blocks, statistic, rng, resamples, level,
                             lambda a, b: b / a if a > 0 else None)


def paired_bootstrap_difference(
    a_blocks: Sequence[Sequence[float]],
    b_blocks: Sequence[Sequence[float]],
    statistic: Statistic,
    rng: Rng,
    resamples: int = 2000,
    level: float = 0.95,
) -> RatioInterval | None:
    """The same bootstrap for statistic(B) − statistic(A) (e.g. a proxy's added latency)."""
    return _paired_bootstrap(a_blocks, b_blocks, statistic, rng, resamples, level,
                             lambda a, b: b - a)


@dataclass(frozen=True, slots=True)
class Trend:
    """Kendall's tau of a series against its order, and the two-sided p-value."""

    tau: float
    p_value: float
    n: int


def _concordance(values: Sequence[float]) -> int:
    """Σ sign(v_j − v_i) over i < j (ties count 0)."""
    s = 0
    for i in range(len(values)):
        for j in range(i + 1, len(values)):
            s += (values[j] > values[i]) - (values[j] < values[i])
    return s


def _inversion_counts(n: int) -> list[int]:
    """How many permutations of n items have k inversions, k = 0..n(n−1)/2 (Mahonian
    numbers, by the usual recurrence)."""
    counts = [1]
    for m in range(2, n + 1):
        grown = [0] * (len(counts) + m - 1)
        for k, c in enumerate(counts):
            for extra in range(m):
                grown[k + extra] += c
        counts = grown
    return counts


def kendall_trend(values: Sequence[float]) -> Trend | None:
    """None with fewer than three values. Exact two-sided p-value (no ties assumed) up to
    `EXACT_KENDALL_MAX_N` values, the normal approximation beyond."""
    n = len(values)
    if n < 3:
        return None
    s = _concordance(values)
    pairs = n * (n - 1) // 2
    if n <= EXACT_KENDALL_MAX_N:
        # S = pairs − 2·inversions, so |S| ≥ |s| counts inversions far from pairs / 2.
        counts = _inversion_counts(n)
        extreme = sum(c for k, c in enumerate(counts) if abs(pairs - 2 * k) >= abs(s))
        p = extreme / math.factorial(n)
    else:
        sigma = math.sqrt(n * (n - 1) * (2 * n + 5) / 18.0)
        z = (abs(s) - 1) / sigma if s else 0.0
        p = math.erfc(z / math.sqrt(2.0))
    return Trend(s / pairs, min(1.0, p), n)
