"""The A/B artifact (`schemas/json/ab_artifact.json`), one per pair and level, validated
before it is written. The compared figure's ratio and interval are recorded only when the
verdict is COMPARABLE: a refused comparison carries its reasons and no result."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
from pathlib import Path
from typing import Any

from governor.bench.analysis import ArmResult, PairResult
from policies.measurement import ArmWarmState, classify_arm
from schemas.bench import (
    ABArtifact,
    Arm,
    ArmFigures,
    Comparison,
    ConfigValue,
    LatencySummary,
    WarmState,
)
from schemas.validate import document, validate

TOOL = "fak bench"


def utc_now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def cpu_flags() -> str:
    """The x86 flags benchmarks on this project are read against (AVX2, AVX512*, AMX)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("flags")), [])
    keep = [f for f in flags if f.startswith(("avx", "amx", "fma", "sse4"))]
    return " ".join(sorted(keep)) or "none"


def cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown"
    return next((line.split(":", 1)[1].strip() for line in text.splitlines()
                 if line.startswith("model name")), platform.processor() or "unknown")


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def machine_line() -> str:
    """The CPU a figure was measured on, for a benchmark's printout."""
    return f"{cpu_model()}, {os.cpu_count()} cores, flags {cpu_flags()}"


def host_facts() -> dict[str, ConfigValue]:
    return {"hostname": platform.node(), "cpu_model": cpu_model(), "cpu_flags": cpu_flags(),
            "cpus": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(), "load_average_start": load_average()}


def _latency(summary: Any) -> LatencySummary:
    if summary is None:
        return LatencySummary()
    return LatencySummary(summary.mean, summary.p50, summary.p90, summary.p99)


def figures(result: ArmResult) -> ArmFigures:
    return ArmFigures(
        repetitions=result.blocks, completed=result.completed, failed=result.failed,
        output_tokens=result.output_tokens, duration_s=result.duration,
        request_throughput=result.request_throughput,
        output_throughput=result.output_throughput, ttft=_latency(result.ttft),
        itl=_latency(result.itl), e2el=_latency(result.e2el),
        prefix_cache_hit_ratio=result.prefix_cache_hit_ratio,
        output_throughput_cv=result.output_throughput_cv)


def build_artifact(pair: PairResult, metric: str, results: dict[str, ArmResult],
                   states: dict[str, WarmState], arm_config: dict[str, dict[str, ConfigValue]],
                   host: dict[str, ConfigValue], workload: dict[str, ConfigValue]
                   ) -> ABArtifact:
    arms = []
    for name in (pair.a, pair.b):
        verdict = classify_arm(ArmWarmState(name, states[name]))
        arms.append(Arm(name=name, engine=str(arm_config[name].get("engine") or "unknown"),
                        config=arm_config[name], warm=states[name],
                        arm_class=verdict.classification, class_reasons=verdict.reasons,
                        figures=figures(results[name])))
    interval = pair.intervals.get(metric)
    decision = pair.decision
    claim = decision.claim_allowed and interval is not None
    reasons = decision.reasons if interval is not None or not decision.claim_allowed else (
        f"{metric}: too few paired blocks for an interval",)
    comparison = Comparison(
        claim_allowed=claim, verdict=decision.verdict if claim or not decision.claim_allowed
        else "NOT COMPARABLE", reasons=tuple(reasons), metric=f"{metric} {pair.b}/{pair.a}",
        ratio=interval.estimate if claim and interval else None,
        ci95_low=interval.low if claim and interval else None,
        ci95_high=interval.high if claim and interval else None)
    return ABArtifact(created_at=utc_now(), tool=TOOL, host=host, workload=workload,
                      arms=tuple(arms), comparison=comparison)


def write_artifact(artifact: ABArtifact, path: Path) -> dict[str, Any]:
    """Validate against the JSON Schema, then write; returns the document."""
    doc = document(artifact)
    validate("ab_artifact", doc)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return doc
