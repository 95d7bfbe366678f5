"""The prompt-cache timing audit of Gu et al. (ICML 2025, arXiv 2502.07776): its prompts, its
schedule, its statistics and its verdict (SEC-5, docs/security.md §3).

A *trial* is one planted prompt and one probe. The planter sends a fresh random prompt P;
then the prober sends either a prompt sharing the first `prefix_fraction` of P's tokens
(a *hit* sample, if the cache is shared) or a fresh random prompt (a *miss* sample). Both
kinds of trial start with a plant, so the only difference between them is whether the probe
shares the planted prefix. Two phases run interleaved in one shuffled schedule: *cross*
(A plants, B probes: the audit proper) and *control* (A plants, A probes: the positive
control that proves caching is detectable on this endpoint at all).

Statistics, on the prober's time to first token: the one-sided two-sample KS test
`ks_2samp(hit, miss, alternative="greater")`. scipy's "greater" alternative is that the first
sample's CDF lies above the second's somewhere — that the hit times are stochastically
*smaller*, as they are when a hit skips prefill. Also the share of hits faster than every
miss.

Randomness is passed in (anything with `random.Random`'s `choices`, `choice`, `shuffle`), so
everything here is deterministic given the generator's seed.
"""

from __future__ import annotations

import math
import statistics
import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

T = TypeVar("T")
Phase = Literal["cross", "control"]
Kind = Literal["hit", "miss"]
PHASES: tuple[Phase, ...] = ("cross", "control")
LETTERS = string.ascii_letters

VERDICT_LEAK = "LEAK"
VERDICT_NO_SIGNAL = "NO CROSS-TENANT SIGNAL"
VERDICT_CONTROL_FAILED = "CONTROL FAILED"


class Rng(Protocol):
    """What the audit needs of a random generator (`random.Random` has it)."""

    def choices(self, population: Sequence[T], *, k: int) -> list[T]: ...

    def choice(self, seq: Sequence[T]) -> T: ...

    def shuffle(self, x: list[T]) -> None: ...


def random_prompt(rng: Rng, n_tokens: int) -> str:
    """`n_tokens` random letters separated by spaces: about one token per letter."""
    return " ".join(rng.choices(LETTERS, k=n_tokens))


def prefix_sharing_prompt(rng: Rng, prompt: str, prefix_fraction: float) -> str:
    """A prompt of the same length sharing exactly `round(len · fraction)` leading tokens
    of `prompt`: the first token after the prefix is forced to differ."""
    tokens = prompt.split(" ")
    keep = round(len(tokens) * prefix_fraction)
    suffix = rng.choices(LETTERS, k=len(tokens) - keep)
    if suffix and suffix[0] == tokens[keep]:
        suffix[0] = rng.choice([c for c in LETTERS if c != tokens[keep]])
    return " ".join(tokens[:keep] + suffix)


@dataclass(frozen=True, slots=True)
class Trial:
    phase: Phase
    kind: Kind


def schedule(rng: Rng, samples: int) -> list[Trial]:
    """`samples` hit and `samples` miss trials per phase, in one random order."""
    if samples < 1:
        raise ValueError("samples must be at least 1")
    trials = [Trial(p, k) for p in PHASES for k in ("hit", "miss") for _ in range(samples)]
    rng.shuffle(trials)
    return trials


@dataclass(frozen=True, slots=True)
class PhaseStats:
    """One phase's hit and miss TTFTs (seconds), summarised. `p_value` is the one-sided KS
    p-value for "hits are faster"; `share_faster` the share of hits below the fastest miss;
    `median_ratio` the miss median over the hit median."""

    n_hit: int
    n_miss: int
    median_hit_s: float
    median_miss_s: float
    median_ratio: float
    ks_statistic: float
    p_value: float
    share_faster: float


def phase_stats(hit: Sequence[float], miss: Sequence[float]) -> PhaseStats:
    if not hit or not miss:
        raise ValueError("both samples must be non-empty")
    if not all(math.isfinite(t) and t >= 0 for t in (*hit, *miss)):
        raise ValueError("times must be finite and non-negative")
    # ~0.5 s to import: only when an audit is summarised
    from scipy.stats import ks_2samp  # type: ignore[import-untyped]

    result = ks_2samp(hit, miss, alternative="greater")
    fastest_miss = min(miss)
    median_hit, median_miss = statistics.median(hit), statistics.median(miss)
    return PhaseStats(
        n_hit=len(hit), n_miss=len(miss), median_hit_s=median_hit, median_miss_s=median_miss,
        median_ratio=median_miss / median_hit if median_hit > 0 else math.inf,
        ks_statistic=float(result.statistic), p_value=float(result.pvalue),
        share_faster=sum(t < fastest_miss for t in hit) / len(hit))


@dataclass(frozen=True, slots=True)
class Thresholds:
    """`alpha`: a cross-tenant p below it is a leak; `control_alpha`: the control must
    reject below it, or the audit proves nothing (SEC-5: 0.01 and 1e-6)."""

    alpha: float = 0.01
    control_alpha: float = 1e-6

    def __post_init__(self) -> None:
        for name in ("alpha", "control_alpha"):
            value = getattr(self, name)
            if not (math.isfinite(value) and 0 < value < 1):
                raise ValueError(f"{name} must be in (0, 1), got {value}")


def verdict(cross: PhaseStats, control: PhaseStats, thresholds: Thresholds) -> str:
    """A cross-tenant signal is a leak whatever the control says (a positive finding needs
    no control); without one, the verdict stands only if the control detected caching."""
    if cross.p_value < thresholds.alpha:
        return VERDICT_LEAK
    if control.p_value >= thresholds.control_alpha:
        return VERDICT_CONTROL_FAILED
    return VERDICT_NO_SIGNAL
