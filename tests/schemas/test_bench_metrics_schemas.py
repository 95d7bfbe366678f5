"""The A/B artifact and normalised serving metrics: records, schema, and agreement with the
policies and adapters that fill them."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest

from adapters.vllm import metrics as vllm_metrics
from policies import measurement
from schemas.bench import (
    VERDICT_COMPARABLE,
    VERDICT_NOT_COMPARABLE,
    ABArtifact,
    Arm,
    ArmClass,
    ArmFigures,
    Comparison,
    CompileCacheState,
    LatencySummary,
    PrefixCacheStart,
    WarmState,
)
from schemas.metrics import ServingMetrics
from schemas.validate import document, errors, validate


def figures(ttft_p50: float = 0.05) -> ArmFigures:
    return ArmFigures(
        repetitions=5, completed=500, failed=0, output_tokens=64_000, duration_s=120.5,
        request_throughput=4.15, output_throughput=531.1,
        ttft=LatencySummary(mean=0.06, p50=ttft_p50, p90=0.09, p99=0.2),
        itl=LatencySummary(mean=0.02, p50=0.019, p90=0.03, p99=0.05),
        e2el=LatencySummary(mean=2.6, p50=2.5, p90=3.1, p99=4.0),
        prefix_cache_hit_ratio=0.42, output_throughput_cv=0.018,
    )


def arm(name: str, arm_class: ArmClass = ArmClass.TUNED, **warm: object) -> Arm:
    state = WarmState(warmup_done=True, compile_cache=CompileCacheState.WARM,
                      request_time_compilation=False,
                      prefix_cache_at_start=PrefixCacheStart.FLUSHED,
                      first_request_latency_s=0.06, steady_state_latency_s=0.05)
    return Arm(name=name, engine="native" if name == "a" else "vllm-0.32.0-cpu",
               config={"block_size": 16, "dtype": "bfloat16", "prefix_caching": True,
                       "max_model_len": 2048, "commit": None},
               warm=dataclasses.replace(state, **warm), arm_class=arm_class,
               class_reasons=() if arm_class is ArmClass.TUNED else ("warmup_incomplete",),
               figures=figures())


def artifact(b: Arm | None = None, comparison: Comparison | None = None) -> ABArtifact:
    return ABArtifact(
        created_at="2025-11-30T08:00:00Z", tool="fak bench 0.1.0",
        host={"cpu": "Xeon 8480", "cores": 16, "governor": "performance"},
        workload={"dataset": "random", "seed": 0, "num_prompts": 100, "input_len": 512,
                  "output_len": 128, "ignore_eos": True, "request_rate": "inf"},
        arms=(arm("a"), b or arm("b")),
        comparison=comparison or Comparison(True, VERDICT_COMPARABLE, (), "ttft.p50", 0.93,
                                            0.88, 0.98),
    )


def test_claimable_artifact_validates() -> None:
    validate("ab_artifact", artifact())


def test_not_comparable_artifact_validates() -> None:
    cold = arm("b", ArmClass.COLD_START, warmup_done=False, compile_cache=None)
    doc = artifact(cold, Comparison(False, VERDICT_NOT_COMPARABLE,
                                    ("arm 'b' is cold_start: warmup_incomplete",)))
    validate("ab_artifact", doc)


def test_dataclass_enforces_the_claim_rule() -> None:
    cold = arm("b", ArmClass.DIAGNOSTIC)
    with pytest.raises(ValueError, match="not tuned"):
        artifact(cold)
    with pytest.raises(ValueError, match="exactly"):
        Comparison(True, VERDICT_NOT_COMPARABLE, ("x",))
    with pytest.raises(ValueError, match="reasons"):
        Comparison(False, VERDICT_NOT_COMPARABLE, ())
    with pytest.raises(ValueError, match="two arms"):
        ABArtifact("2025-11-30T08:00:00Z", "t", {}, {}, (arm("a"),),
                   Comparison(False, VERDICT_NOT_COMPARABLE, ("one arm",)))
    with pytest.raises(ValueError, match="unique"):
        ABArtifact("2025-11-30T08:00:00Z", "t", {}, {}, (arm("a"), arm("a")),
                   Comparison(False, VERDICT_NOT_COMPARABLE, ("dup",)))
    with pytest.raises(ValueError):
        LatencySummary(p50=0.2, p90=0.1)
    with pytest.raises(ValueError):
        dataclasses.replace(figures(), prefix_cache_hit_ratio=1.5)
    with pytest.raises(ValueError):
        dataclasses.replace(figures(), duration_s=math.nan)
    with pytest.raises(ValueError):
        WarmState(first_request_latency_s=-1.0)


def _broken(mutate) -> dict:
    doc = document(artifact())
    mutate(doc)
    return doc


def _untuned_but_claimed(doc: dict) -> None:
    doc["arms"][1]["arm_class"] = "cold_start"


BROKEN = {
    "one arm": lambda d: d["arms"].pop(),
    "untuned arm with a claim": _untuned_but_claimed,
    "claim with wrong verdict": lambda d: d["comparison"].update(verdict="NOT COMPARABLE"),
    "refusal without reasons": lambda d: d["comparison"].update(
        claim_allowed=False, verdict="NOT COMPARABLE", reasons=[]),
    "unknown verdict": lambda d: d["comparison"].update(verdict="FASTER"),
    "unknown class": lambda d: d["arms"][0].update(arm_class="great"),
    "missing figures": lambda d: d["arms"][0].pop("figures"),
    "missing warm field": lambda d: d["arms"][0]["warm"].pop("compile_cache"),
    "bad compile cache": lambda d: d["arms"][0]["warm"].update(compile_cache="lukewarm"),
    "negative ttft": lambda d: d["arms"][0]["figures"]["ttft"].update(p50=-0.1),
    "string count": lambda d: d["arms"][0]["figures"].update(completed="500"),
    "hit ratio above 1": lambda d: d["arms"][0]["figures"].update(prefix_cache_hit_ratio=2),
    "nested config": lambda d: d["arms"][0]["config"].update(extra={"a": 1}),
    "extra arm field": lambda d: d["arms"][0].update(notes="x"),
    "extra top-level": lambda d: d.update(verdict="COMPARABLE"),
    "bad date": lambda d: d.update(created_at="yesterday"),
    "schema version": lambda d: d.update(schema_version=2),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_artifacts_are_rejected(name: str) -> None:
    assert errors("ab_artifact", _broken(BROKEN[name])), name


def test_bench_enums_and_warm_state_match_the_measurement_policy() -> None:
    for mine, theirs in ((ArmClass, measurement.ArmClass),
                         (CompileCacheState, measurement.CompileCacheState),
                         (PrefixCacheStart, measurement.PrefixCacheStart)):
        assert [m.value for m in mine] == [m.value for m in theirs]
    assert measurement.WarmState is WarmState  # the policy gates the artifact's own record
    assert (VERDICT_COMPARABLE, VERDICT_NOT_COMPARABLE) == (
        measurement.VERDICT_COMPARABLE, measurement.VERDICT_NOT_COMPARABLE)


def test_gate_output_fits_the_artifact() -> None:
    """The policy's verdict, carried into the artifact, always satisfies the schema."""
    warm = WarmState(True, measurement.CompileCacheState.WARM, False,
                     measurement.PrefixCacheStart.FLUSHED, 0.06, 0.05)
    good = measurement.ArmWarmState("a", warm)
    cold = measurement.ArmWarmState("b", dataclasses.replace(warm, first_request_latency_s=1.0))
    for arms in ((good, dataclasses.replace(good, arm="b")), (good, cold)):
        gate = measurement.gate_comparison(arms)
        built = (arm("a", ArmClass(gate.arms[0].classification.value)),
                 arm("b", ArmClass(gate.arms[1].classification.value)))
        doc = ABArtifact("2025-11-30T08:00:00Z", "t", {}, {}, built,
                         Comparison(gate.claim_allowed, gate.verdict, gate.reasons))
        validate("ab_artifact", doc)


# --- serving metrics ----------------------------------------------------------------------


def test_serving_metrics_absent_is_none_and_gauges_skip_it() -> None:
    m = ServingMetrics(running=2, waiting=0, kv_usage=0.25, prefix_cache_queries=1000,
                       prefix_cache_hits=400, prefix_cache_hit_ratio=0.4, ttft_p50=0.03)
    assert m.itl_p99 is None and m.cached_tokens is None
    gauges = m.as_gauges()
    assert gauges["fak_serving_prefix_cache_hit_ratio"] == 0.4
    assert gauges["fak_serving_waiting"] == 0.0  # an exported 0 stays 0
    assert "fak_serving_itl_p99" not in gauges and "fak_serving_cached_tokens" not in gauges
    assert ServingMetrics().as_gauges() == {}


@pytest.mark.parametrize("bad", [
    {"kv_usage": 1.5}, {"prefix_cache_hit_ratio": 1.01}, {"running": -1},
    {"ttft_p50": math.inf}, {"preemptions": math.nan}, {"waiting": True}, {"running": "3"},
])
def test_serving_metrics_refuse_bad_values(bad: dict) -> None:
    with pytest.raises((ValueError, TypeError)):
        ServingMetrics(**bad)


def test_serving_metrics_fields_match_the_vllm_normaliser() -> None:
    mine = [f.name for f in dataclasses.fields(ServingMetrics)]
    assert mine == [f.name for f in dataclasses.fields(vllm_metrics.ServingMetrics)]


def test_artifact_document_is_plain_json() -> None:
    doc = document(artifact())
    assert doc["arms"][0]["arm_class"] == "tuned"
    assert isinstance(doc["arms"][0]["class_reasons"], list)
    assert copy.deepcopy(doc) == doc
