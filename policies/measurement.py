"""Measurement gates: is an A/B arm warm enough to be compared? (docs/design.md §3,
docs/reference/benchmarking.md §6)

Each arm carries its warm state. A field left `None` was *not observed*, which is different
from an observed `False`. Classification takes the first rule that fires:

1. request-time compilation observed            → `cold_start`
2. compile/JIT cache disabled                   → `cold_start`
3. warm-up observed incomplete                  → `cold_start`
4. first measured request ≥ `cold_latency_ratio` × steady-state latency → `cold_start`
5. any warm-state field not observed             → `diagnostic`
6. prefix cache at start held measured prompts  → `diagnostic`
7. otherwise                                    → `tuned`

An operator declaration can only make the verdict worse (tuned < diagnostic < cold_start):
it never lifts an arm, and an observed cold start overrides a declared `tuned`.
A comparison is claimable only when every arm is `tuned` and all arms started from the same
prefix-cache state; otherwise the verdict is "NOT COMPARABLE" with the reasons.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

from schemas.bench import (
    VERDICT_COMPARABLE,
    VERDICT_NOT_COMPARABLE,
    ArmClass,
    CompileCacheState,
    PrefixCacheStart,
    WarmState,
)


def _severity(classification: ArmClass) -> int:
    return (ArmClass.TUNED, ArmClass.DIAGNOSTIC, ArmClass.COLD_START).index(classification)


@dataclass(frozen=True, slots=True)
class GateConfig:
    """`cold_latency_ratio`: first-request latency at or above this multiple of the
    steady-state latency marks the arm cold (default 3×)."""

    cold_latency_ratio: float = 3.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.cold_latency_ratio) and self.cold_latency_ratio > 1.0):
            raise ValueError(
                f"cold_latency_ratio must be finite and > 1, got {self.cold_latency_ratio}"
            )


@dataclass(frozen=True, slots=True)
class ArmWarmState:
    """One named arm and its observed warm state. Latencies in `state` are seconds: the
    first measured request after warm-up, and the steady-state (median) latency of the rest
    of the run; the gate needs both positive when observed."""

    arm: str
    state: WarmState = field(default_factory=WarmState)

    def __post_init__(self) -> None:
        if not isinstance(self.arm, str) or not self.arm:
            raise ValueError("arm name must be a non-empty string")
        if not isinstance(self.state, WarmState):
            raise TypeError("state must be a schemas.bench.WarmState")
        for name in ("first_request_latency_s", "steady_state_latency_s"):
            value = getattr(self.state, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be finite and > 0, got {value}")

    def unobserved(self) -> tuple[str, ...]:
        return tuple(
            f.name
            for f in fields(self.state)
            if f.name != "declared" and getattr(self.state, f.name) is None
        )


@dataclass(frozen=True, slots=True)
class ArmVerdict:
    arm: str
    classification: ArmClass
    reasons: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ComparisonGate:
    claim_allowed: bool
    verdict: str
    reasons: tuple[str, ...]
    arms: tuple[ArmVerdict, ...]


def _cold_reasons(arm: ArmWarmState, config: GateConfig) -> list[str]:
    state = arm.state
    reasons = []
    if state.request_time_compilation is True:
        reasons.append("request_time_compilation_observed")
    if state.compile_cache is CompileCacheState.DISABLED:
        reasons.append("compile_cache_disabled")
    if state.warmup_done is False:
        reasons.append("warmup_incomplete")
    first, steady = state.first_request_latency_s, state.steady_state_latency_s
    if first is not None and steady is not None and first >= config.cold_latency_ratio * steady:
        reasons.append(
            f"first_request_latency_{first / steady:.1f}x_steady_state"
            f"_threshold_{config.cold_latency_ratio:g}x"
        )
    return reasons


def classify_arm(state: ArmWarmState, config: GateConfig = GateConfig()) -> ArmVerdict:
    """Classify one arm by the precedence in the module docstring; reasons list every finding."""
    reasons = _cold_reasons(state, config)
    computed = ArmClass.COLD_START if reasons else ArmClass.TUNED
    unobserved = state.unobserved()
    if unobserved:
        reasons.append("not_observed:" + ",".join(unobserved))
    declared = state.state.declared
    if state.state.prefix_cache_at_start is PrefixCacheStart.CONTAMINATED:
        reasons.append("prefix_cache_contaminated")
    if computed is ArmClass.TUNED and (unobserved or "prefix_cache_contaminated" in reasons):
        computed = ArmClass.DIAGNOSTIC
    if declared is not None and _severity(declared) > _severity(computed):
        reasons.append(f"declared_{declared.value}")
        computed = declared
    return ArmVerdict(state.arm, computed, tuple(reasons))


def gate_comparison(
    arms: Sequence[ArmWarmState], config: GateConfig = GateConfig()
) -> ComparisonGate:
    """The A/B gate: one non-tuned arm, or differing prefix-cache starts, forbid a claim."""
    if len(arms) < 2:
        raise ValueError("a comparison needs at least two arms")
    names = [a.arm for a in arms]
    if len(set(names)) != len(names):
        raise ValueError(f"arm names must be unique, got {names}")
    verdicts = tuple(classify_arm(a, config) for a in arms)
    reasons = [
        f"arm {v.arm!r} is {v.classification.value}: {'; '.join(v.reasons)}"
        for v in verdicts
        if v.classification is not ArmClass.TUNED
    ]
    starts = {a.state.prefix_cache_at_start for a in arms}
    if len(starts) > 1:
        reasons.append(
            "prefix cache state at start differs: "
            + ", ".join(f"{a.arm}={a.state.prefix_cache_at_start}" for a in arms)
        )
    allowed = not reasons
    return ComparisonGate(
        claim_allowed=allowed,
        verdict=VERDICT_COMPARABLE if allowed else VERDICT_NOT_COMPARABLE,
        reasons=tuple(reasons),
        arms=verdicts,
    )
