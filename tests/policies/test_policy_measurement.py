"""Measurement gates: arm classification precedence and the A/B comparison gate."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.measurement import (
    VERDICT_COMPARABLE,
    VERDICT_NOT_COMPARABLE,
    ArmClass,
    ArmWarmState,
    CompileCacheState,
    GateConfig,
    PrefixCacheStart,
    classify_arm,
    gate_comparison,
)
from schemas.bench import WarmState

TUNED = ArmWarmState("native", WarmState(
    warmup_done=True,
    compile_cache=CompileCacheState.WARM,
    request_time_compilation=False,
    prefix_cache_at_start=PrefixCacheStart.FLUSHED,
    first_request_latency_s=0.12,
    steady_state_latency_s=0.10,
))


def arm(name: str = "native", **changes: object) -> ArmWarmState:
    return ArmWarmState(name, dataclasses.replace(TUNED.state, **changes))


def test_fully_observed_warm_arm_is_tuned() -> None:
    verdict = classify_arm(TUNED)
    assert verdict.classification is ArmClass.TUNED and verdict.reasons == ()


@pytest.mark.parametrize(
    ("changes", "expected", "first_reason"),
    [
        ({"request_time_compilation": True}, ArmClass.COLD_START, "request_time_compilation"),
        ({"compile_cache": CompileCacheState.DISABLED}, ArmClass.COLD_START, "compile_cache_dis"),
        ({"warmup_done": False}, ArmClass.COLD_START, "warmup_incomplete"),
        ({"first_request_latency_s": 0.31}, ArmClass.COLD_START, "first_request_latency_3.1x"),
        ({"first_request_latency_s": 0.29}, ArmClass.TUNED, None),
        ({"compile_cache": CompileCacheState.COLD}, ArmClass.TUNED, None),
        ({"compile_cache": CompileCacheState.NOT_APPLICABLE}, ArmClass.TUNED, None),
        ({"prefix_cache_at_start": PrefixCacheStart.WARM_DISJOINT}, ArmClass.TUNED, None),
        ({"prefix_cache_at_start": PrefixCacheStart.CONTAMINATED}, ArmClass.DIAGNOSTIC, "prefix"),
        ({"warmup_done": None}, ArmClass.DIAGNOSTIC, "not_observed:warmup_done"),
        ({"compile_cache": None}, ArmClass.DIAGNOSTIC, "not_observed:compile_cache"),
        ({"request_time_compilation": None}, ArmClass.DIAGNOSTIC, "not_observed:request_time"),
        ({"prefix_cache_at_start": None}, ArmClass.DIAGNOSTIC, "not_observed:prefix_cache"),
        ({"first_request_latency_s": None}, ArmClass.DIAGNOSTIC, "not_observed:first_request"),
        ({"steady_state_latency_s": None}, ArmClass.DIAGNOSTIC, "not_observed:steady_state"),
    ],
)
def test_single_findings(changes: dict, expected: ArmClass, first_reason: str | None) -> None:
    verdict = classify_arm(arm(**changes))
    assert verdict.classification is expected
    if first_reason is None:
        assert verdict.reasons == ()
    else:
        assert verdict.reasons[0].startswith(first_reason)


def test_not_observed_differs_from_observed_false() -> None:
    assert classify_arm(arm(warmup_done=None)).classification is ArmClass.DIAGNOSTIC
    assert classify_arm(arm(warmup_done=False)).classification is ArmClass.COLD_START
    assert classify_arm(arm(request_time_compilation=None)).classification is ArmClass.DIAGNOSTIC
    assert classify_arm(arm(request_time_compilation=False)).classification is ArmClass.TUNED


def test_cold_beats_unobserved_and_reasons_keep_precedence_order() -> None:
    state = ArmWarmState("x", WarmState(
        request_time_compilation=True,
        compile_cache=CompileCacheState.DISABLED,
        warmup_done=False,
        first_request_latency_s=5.0,
        steady_state_latency_s=1.0,
    ))
    verdict = classify_arm(state)
    assert verdict.classification is ArmClass.COLD_START
    assert [r.split("_")[0] for r in verdict.reasons] == [
        "request", "compile", "warmup", "first", "not"
    ]  # fmt: skip
    assert verdict.reasons[-1] == "not_observed:prefix_cache_at_start"


def test_nothing_observed_is_diagnostic() -> None:
    verdict = classify_arm(ArmWarmState(arm="x"))
    assert verdict.classification is ArmClass.DIAGNOSTIC


def test_observed_cold_overrides_declared_tuned() -> None:
    state = arm(declared=ArmClass.TUNED, first_request_latency_s=2.0)
    assert classify_arm(state).classification is ArmClass.COLD_START
    assert classify_arm(arm(declared=ArmClass.TUNED, warmup_done=None)).classification is (
        ArmClass.DIAGNOSTIC
    )


def test_declaration_can_only_worsen() -> None:
    verdict = classify_arm(arm(declared=ArmClass.COLD_START))
    assert verdict.classification is ArmClass.COLD_START
    assert verdict.reasons == ("declared_cold_start",)
    assert classify_arm(arm(declared=ArmClass.DIAGNOSTIC)).classification is ArmClass.DIAGNOSTIC
    assert classify_arm(arm(declared=ArmClass.TUNED)).classification is ArmClass.TUNED


def test_latency_threshold_is_inclusive() -> None:
    exact = arm(first_request_latency_s=0.375, steady_state_latency_s=0.125)
    assert classify_arm(exact).classification is ArmClass.COLD_START


def test_latency_threshold_is_a_parameter() -> None:
    state = arm(first_request_latency_s=0.25)
    assert classify_arm(state, GateConfig(cold_latency_ratio=3.0)).classification is ArmClass.TUNED
    assert classify_arm(state, GateConfig(cold_latency_ratio=2.0)).classification is (
        ArmClass.COLD_START
    )


@pytest.mark.parametrize("ratio", [1.0, 0.5, float("inf"), float("nan")])
def test_bad_threshold_is_refused(ratio: float) -> None:
    with pytest.raises(ValueError):
        GateConfig(cold_latency_ratio=ratio)


@pytest.mark.parametrize("latency", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_latency_is_refused(latency: float) -> None:
    with pytest.raises(ValueError):
        arm(first_request_latency_s=latency)


def test_two_tuned_arms_are_comparable() -> None:
    gate = gate_comparison([TUNED, arm("vllm")])
    assert gate.claim_allowed and gate.verdict == VERDICT_COMPARABLE and gate.reasons == ()


def test_one_cold_arm_poisons_the_comparison() -> None:
    gate = gate_comparison([TUNED, arm("vllm", request_time_compilation=True)])
    assert not gate.claim_allowed
    assert gate.verdict == VERDICT_NOT_COMPARABLE
    assert gate.reasons == ("arm 'vllm' is cold_start: request_time_compilation_observed",)
    assert [v.classification for v in gate.arms] == [ArmClass.TUNED, ArmClass.COLD_START]


def test_one_unobserved_arm_poisons_the_comparison() -> None:
    gate = gate_comparison([TUNED, arm("vllm", compile_cache=None)])
    assert not gate.claim_allowed and "diagnostic" in gate.reasons[0]


def test_different_prefix_cache_starts_are_not_comparable() -> None:
    other = arm("vllm", prefix_cache_at_start=PrefixCacheStart.WARM_DISJOINT)
    gate = gate_comparison([TUNED, other])
    assert not gate.claim_allowed
    assert gate.reasons[0].startswith("prefix cache state at start differs")


def test_gate_input_errors() -> None:
    with pytest.raises(ValueError, match="two arms"):
        gate_comparison([TUNED])
    with pytest.raises(ValueError, match="unique"):
        gate_comparison([TUNED, TUNED])
    with pytest.raises(ValueError):
        ArmWarmState(arm="")


optional_bool = st.none() | st.booleans()
states = st.builds(ArmWarmState, arm=st.sampled_from(["a", "b", "c"]), state=st.builds(
    WarmState,
    warmup_done=optional_bool,
    compile_cache=st.none() | st.sampled_from(CompileCacheState),
    request_time_compilation=optional_bool,
    prefix_cache_at_start=st.none() | st.sampled_from(PrefixCacheStart),
    first_request_latency_s=st.none() | st.floats(0.001, 10.0),
    steady_state_latency_s=st.none() | st.floats(0.001, 10.0),
    declared=st.none() | st.sampled_from(ArmClass),
))


@settings(max_examples=200, deadline=None)
@given(a=states, b=states)
def test_gate_allows_claim_only_when_every_arm_is_tuned(a: ArmWarmState, b: ArmWarmState) -> None:
    b = dataclasses.replace(b, arm=a.arm + "2")
    gate = gate_comparison([a, b])
    all_tuned = all(v.classification is ArmClass.TUNED for v in gate.arms)
    same_start = a.state.prefix_cache_at_start == b.state.prefix_cache_at_start
    assert gate.claim_allowed is (all_tuned and same_start)
    assert (gate.verdict == VERDICT_COMPARABLE) is gate.claim_allowed
    for state, verdict in zip((a, b), gate.arms, strict=True):
        if state.state.request_time_compilation or state.state.warmup_done is False:
            assert verdict.classification is ArmClass.COLD_START
        if verdict.classification is ArmClass.TUNED:
            assert not state.unobserved() and state.state.declared in (None, ArmClass.TUNED)
