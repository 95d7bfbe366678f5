"""When an A/B run may state a result: the rules beyond the warm gate (docs/reference/
benchmarking.md §6; `policies.measurement` classifies each arm's warm state).

A comparison is NOT COMPARABLE when any of these holds, and every one found is a reason:

- an arm is not `tuned` or the arms' prefix-cache starts differ (`gate_comparison`);
- a request reported more cached prompt tokens than this run could have put in the cache
  (`PromptHistory.bound`): the cache held someone else's prompts, e.g. an earlier run's;
- an arm had failed requests (more than `max_failed`);
- the arms completed different numbers of requests or output tokens (unequal work);
- an arm's per-block output throughput varies by more than `max_cv` (coefficient of
  variation), so run-to-run noise is larger than the differences worth claiming;
- a pair's per-block ratio trends with block order (Kendall, p < `drift_p`): one arm
  drifted during the run, which interleaving exposes and a sequential run would hide.

Pure: no I/O, no clocks.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from policies.ab_stats import kendall_trend
from policies.measurement import ArmWarmState, ComparisonGate, GateConfig, gate_comparison
from schemas.bench import VERDICT_COMPARABLE, VERDICT_NOT_COMPARABLE


@dataclass(frozen=True, slots=True)
class ABGateConfig:
    max_cv: float = 0.10
    drift_p: float = 0.01
    max_failed: int = 0
    warm: GateConfig = field(default_factory=GateConfig)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.max_cv) and self.max_cv > 0):
            raise ValueError(f"max_cv must be finite and > 0, got {self.max_cv}")
        if not 0.0 < self.drift_p < 1.0:
            raise ValueError(f"drift_p must be within (0, 1), got {self.drift_p}")
        if self.max_failed < 0:
            raise ValueError("max_failed must be ≥ 0")


class PromptHistory:
    """The prompts (token ids) one arm has been sent in this run, sorted, so the longest
    prefix a new prompt shares with any of them is found next to it (its sorted
    neighbours share the longest prefix). An engine can have cached at most that many of
    the new prompt's tokens from this run, plus the tokens it adds in front (a BOS)."""

    def __init__(self, added_tokens: int = 0) -> None:
        if added_tokens < 0:
            raise ValueError("added_tokens must be ≥ 0")
        self.added_tokens = added_tokens
        self._sorted: list[tuple[int, ...]] = []

    def __len__(self) -> int:
        return len(self._sorted)

    @staticmethod
    def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
        n = 0
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            n += 1
        return n

    def bound(self, prompt: Sequence[int]) -> int:
        """Most cached tokens `prompt` can honestly report, given every prompt this run
        has sent so far (the prompt itself counted once if it was added: a request can be
        served from a later-sent one that reached the engine first, so bound at the end of
        a request, not at its start)."""
        key = tuple(prompt)
        lo = bisect.bisect_left(self._sorted, key)
        hi = bisect.bisect_right(self._sorted, key)
        if hi - lo >= 2:  # the same prompt was sent twice
            return len(key) + self.added_tokens
        neighbours = (lo - 1, hi if hi > lo else lo)
        shared = max((self._common(key, self._sorted[i]) for i in neighbours
                      if 0 <= i < len(self._sorted)), default=0)
        return shared + self.added_tokens

    def add(self, prompt: Sequence[int]) -> None:
        bisect.insort(self._sorted, tuple(prompt))

    def check_integrity(self) -> None:
        if self._sorted != sorted(self._sorted):
            raise AssertionError("prompt history is not sorted")


@dataclass(frozen=True, slots=True)
class ArmRunFacts:
    """What one arm's measured blocks showed. `cached_beyond_bound`: requests that reported
    more cached tokens than `PromptHistory.bound` allowed; `first_error`: what the first
    failed request said (empty when none failed)."""

    arm: str
    completed: int
    failed: int
    output_tokens: int
    cached_beyond_bound: int
    output_throughput_cv: float | None
    first_error: str = ""

    def __post_init__(self) -> None:
        for name in ("completed", "failed", "output_tokens", "cached_beyond_bound"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be ≥ 0")


@dataclass(frozen=True, slots=True)
class ABDecision:
    claim_allowed: bool
    verdict: str
    reasons: tuple[str, ...]
    warm_gate: ComparisonGate


def run_reasons(facts: Sequence[ArmRunFacts], config: ABGateConfig) -> list[str]:
    reasons = []
    for f in facts:
        if f.cached_beyond_bound:
            reasons.append(f"arm {f.arm!r}: {f.cached_beyond_bound} request(s) reported cached "
                           f"prompt tokens this run had not sent (the prefix cache was not "
                           f"cold at start)")
        if f.failed > config.max_failed:
            first = f", the first: {' '.join(f.first_error.split())}" if f.first_error else ""
            reasons.append(f"arm {f.arm!r}: {f.failed} failed request(s){first}")
        if f.output_throughput_cv is not None and f.output_throughput_cv > config.max_cv:
            reasons.append(f"arm {f.arm!r}: output throughput CV {f.output_throughput_cv:.1%} "
                           f"over blocks exceeds {config.max_cv:.0%}")
    for what in ("completed", "output_tokens"):
        totals = {f.arm: getattr(f, what) for f in facts}
        if len(set(totals.values())) > 1:
            reasons.append(f"unequal {what.replace('_', ' ')} between arms: "
                           + ", ".join(f"{a}={v}" for a, v in totals.items()))
    return reasons


def drift_reasons(pair_ratios: Mapping[str, Sequence[float]], config: ABGateConfig) -> list[str]:
    """`pair_ratios`: per pair name, the per-block B/A ratios in the order blocks ran."""
    reasons = []
    for pair, ratios in pair_ratios.items():
        trend = kendall_trend(ratios)
        if trend is not None and trend.p_value < config.drift_p:
            reasons.append(f"pair {pair}: per-block ratio drifts over the run (Kendall tau "
                           f"{trend.tau:+.2f}, p={trend.p_value:.3g} over {trend.n} blocks)")
    return reasons


def decide(warm: Sequence[ArmWarmState], facts: Sequence[ArmRunFacts],
           pair_ratios: Mapping[str, Sequence[float]],
           config: ABGateConfig = ABGateConfig()) -> ABDecision:
    """The verdict: COMPARABLE only when no rule of the module docstring fires."""
    if {w.arm for w in warm} != {f.arm for f in facts}:
        raise ValueError("warm states and run facts must name the same arms")
    gate = gate_comparison(warm, config.warm)
    reasons = [*gate.reasons, *run_reasons(facts, config), *drift_reasons(pair_ratios, config)]
    allowed = not reasons
    return ABDecision(allowed, VERDICT_COMPARABLE if allowed else VERDICT_NOT_COMPARABLE,
                      tuple(reasons), gate)
