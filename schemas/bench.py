"""The A/B benchmark artifact (docs/reference/benchmarking.md §6, docs/design.md §3 "measurement
gates").

One artifact per comparison: every arm with its engine, configuration, warm state,
classification and figures, and the comparison verdict. The rule it encodes: one arm that
is not `tuned` forbids a claim — `claim_allowed` is true exactly when the verdict is
`COMPARABLE`, and then every arm is `tuned`. Figures follow `vllm bench serve` definitions
(seconds, not ms); a figure that was not measured is None.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, fields

from schemas.values import is_int

VERDICT_COMPARABLE = "COMPARABLE"
VERDICT_NOT_COMPARABLE = "NOT COMPARABLE"
ConfigValue = str | int | float | bool | None


class ArmClass(enum.StrEnum):
    TUNED = "tuned"
    DIAGNOSTIC = "diagnostic"
    COLD_START = "cold_start"


class CompileCacheState(enum.StrEnum):
    WARM = "warm"
    COLD = "cold"
    DISABLED = "disabled"
    NOT_APPLICABLE = "not_applicable"


class PrefixCacheStart(enum.StrEnum):
    FLUSHED = "flushed"
    WARM_DISJOINT = "warm_disjoint"
    CONTAMINATED = "contaminated"


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_nonneg(owner: object) -> None:
    """Every numeric field of `owner` is finite and ≥ 0 (None allowed)."""
    for f in fields(owner):  # type: ignore[arg-type]
        value = getattr(owner, f.name)
        if _is_number(value):
            _require(math.isfinite(value) and value >= 0, f"{f.name} must be finite and ≥ 0")


@dataclass(frozen=True, slots=True)
class WarmState:
    """Observed warm state of an arm (None = not observed, which is not False)."""

    warmup_done: bool | None = None
    compile_cache: CompileCacheState | None = None
    request_time_compilation: bool | None = None
    prefix_cache_at_start: PrefixCacheStart | None = None
    first_request_latency_s: float | None = None
    steady_state_latency_s: float | None = None
    declared: ArmClass | None = None

    def __post_init__(self) -> None:
        _check_nonneg(self)


@dataclass(frozen=True, slots=True)
class LatencySummary:
    """Seconds: mean and percentiles (np.percentile, linear interpolation)."""

    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None

    def __post_init__(self) -> None:
        _check_nonneg(self)
        present = [v for v in (self.p50, self.p90, self.p99) if v is not None]
        _require(present == sorted(present), "percentiles must not decrease")


@dataclass(frozen=True, slots=True)
class ArmFigures:
    """One arm's results pooled over `repetitions` runs; `*_cv` is the coefficient of
    variation of the per-run value across repetitions."""

    repetitions: int
    completed: int
    failed: int
    output_tokens: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    ttft: LatencySummary
    itl: LatencySummary
    e2el: LatencySummary
    prefix_cache_hit_ratio: float | None = None
    output_throughput_cv: float | None = None

    def __post_init__(self) -> None:
        _check_nonneg(self)
        for name in ("repetitions", "completed", "failed", "output_tokens"):
            value = getattr(self, name)
            _require(is_int(value), f"{name} must be an int")
        _require(self.repetitions >= 1, "repetitions must be ≥ 1")
        ratio = self.prefix_cache_hit_ratio
        _require(ratio is None or ratio <= 1, "prefix_cache_hit_ratio is a fraction 0..1")


@dataclass(frozen=True, slots=True)
class Arm:
    name: str
    engine: str
    config: dict[str, ConfigValue]
    warm: WarmState
    arm_class: ArmClass
    class_reasons: tuple[str, ...]
    figures: ArmFigures

    def __post_init__(self) -> None:
        _require(isinstance(self.name, str) and bool(self.name), "arm name must be non-empty")
        _require(isinstance(self.engine, str) and bool(self.engine), "arm engine must be named")
        _require(isinstance(self.arm_class, ArmClass), "arm_class must be an ArmClass")
        for key, value in self.config.items():
            scalar = value is None or isinstance(value, str | int | float)
            _require(isinstance(key, str) and scalar, f"config {key!r} must map to a scalar")


@dataclass(frozen=True, slots=True)
class Comparison:
    """`metric`/`ratio`/`ci95_*`: the compared figure (e.g. `ttft.p50`), B/A ratio and its
    bootstrap 95% interval, when measured."""

    claim_allowed: bool
    verdict: str
    reasons: tuple[str, ...]
    metric: str | None = None
    ratio: float | None = None
    ci95_low: float | None = None
    ci95_high: float | None = None

    def __post_init__(self) -> None:
        _require(self.verdict in (VERDICT_COMPARABLE, VERDICT_NOT_COMPARABLE),
                 f"verdict must be {VERDICT_COMPARABLE!r} or {VERDICT_NOT_COMPARABLE!r}")
        _require(self.claim_allowed == (self.verdict == VERDICT_COMPARABLE),
                 "claim_allowed must be true exactly when the verdict is COMPARABLE")
        _require(self.claim_allowed or bool(self.reasons), "a refused claim needs reasons")
        _check_nonneg(self)


@dataclass(frozen=True, slots=True)
class ABArtifact:
    """`created_at`: ISO 8601 UTC; `tool`: what produced the figures, with its version;
    `host` and `workload`: the facts docs/reference/benchmarking.md §6 rules 1-4 require be
    recorded."""

    created_at: str
    tool: str
    host: dict[str, ConfigValue]
    workload: dict[str, ConfigValue]
    arms: tuple[Arm, ...]
    comparison: Comparison
    schema_version: int = 1

    def __post_init__(self) -> None:
        self.check_integrity()

    def check_integrity(self) -> None:
        _require(len(self.arms) >= 2, "an A/B artifact needs at least two arms")
        names = [a.name for a in self.arms]
        _require(len(names) == len(set(names)), f"arm names must be unique, got {names}")
        untuned = [a.name for a in self.arms if a.arm_class is not ArmClass.TUNED]
        _require(not (untuned and self.comparison.claim_allowed),
                 f"arms {untuned} are not tuned, so no claim is allowed")
