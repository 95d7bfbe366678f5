"""policies.ab_stats and policies.ab_gate: percentiles as numpy computes them, the paired
bootstrap, Kendall's trend test, the cache bound and every NOT COMPARABLE rule."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.ab_gate import ABGateConfig, ArmRunFacts, PromptHistory, decide, run_reasons
from policies.ab_stats import (
    coefficient_of_variation,
    kendall_trend,
    median,
    paired_bootstrap_difference,
    paired_bootstrap_ratio,
    percentile,
    summarize,
)
from policies.measurement import ArmWarmState
from schemas.bench import CompileCacheState, PrefixCacheStart, WarmState

floats = st.floats(min_value=0.0, max_value=1e6, allow_nan=False)


@given(st.lists(floats, min_size=1, max_size=50), st.floats(min_value=0, max_value=100))
def test_percentile_is_numpys_linear_interpolation(values: list[float], q: float) -> None:
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-9,
                                                  abs=1e-9)


def test_summary_and_cv() -> None:
    s = summarize([1.0, 2.0, 3.0, 4.0])
    assert s is not None and s.mean == 2.5 and s.p50 == 2.5
    assert s.std == pytest.approx(float(np.std([1, 2, 3, 4])))
    assert summarize([]) is None
    assert coefficient_of_variation([2.0, 2.0, 2.0]) == 0.0
    assert coefficient_of_variation([1.0]) is None
    assert coefficient_of_variation([1.0, 3.0]) == pytest.approx(math.sqrt(2) / 2)


def test_bootstrap_is_reproducible_and_brackets_a_known_ratio() -> None:
    rng = random.Random(7)
    a = [[rng.lognormvariate(0, 0.1) for _ in range(20)] for _ in range(6)]
    b = [[2 * x for x in block] for block in a]
    one = paired_bootstrap_ratio(a, b, median, random.Random(1), 500)
    two = paired_bootstrap_ratio(a, b, median, random.Random(1), 500)
    assert one == two and one is not None
    assert one.estimate == pytest.approx(2.0) and one.contains(2.0) and one.excludes_one()
    diff = paired_bootstrap_difference(a, a, median, random.Random(1), 500)
    assert diff is not None and diff.estimate == 0.0 and diff.contains(0.0)


def test_bootstrap_refuses_what_it_cannot_pair() -> None:
    with pytest.raises(ValueError):
        paired_bootstrap_ratio([[1.0]], [[1.0], [2.0]], median, random.Random(0))
    assert paired_bootstrap_ratio([[1.0]], [[1.0]], median, random.Random(0)) is None
    assert paired_bootstrap_ratio([[0.0], [0.0]], [[1.0], [1.0]], median,
                                  random.Random(0)) is None


def test_kendall_exact_p_values() -> None:
    trend = kendall_trend([1, 2, 3, 4, 5])
    assert trend is not None and trend.tau == 1.0
    assert trend.p_value == pytest.approx(2 / 120)
    flat = kendall_trend([3, 1, 2, 5, 4])
    assert flat is not None and flat.p_value > 0.3
    assert kendall_trend([1.0, 2.0]) is None
    long = kendall_trend(list(range(30)))
    assert long is not None and long.p_value < 1e-6


def test_prompt_history_bounds_what_a_cache_can_hold() -> None:
    h = PromptHistory()
    h.add((1, 2, 3, 4))
    assert h.bound((1, 2, 3, 4)) == 0  # only itself: nothing to reuse
    h.add((1, 2, 9))
    assert h.bound((1, 2, 9)) == 2 and h.bound((1, 2, 3, 4)) == 2
    h.add((1, 2, 3, 4))
    assert h.bound((1, 2, 3, 4)) == 4  # sent twice
    assert PromptHistory(added_tokens=1).bound((5, 6)) == 1  # a shared BOS
    h.check_integrity()


@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6), min_size=1, max_size=20))
def test_prompt_history_bound_is_the_longest_shared_prefix(prompts: list[list[int]]) -> None:
    h = PromptHistory()
    for p in prompts:
        h.add(p)
    for i, p in enumerate(prompts):
        others = prompts[:i] + prompts[i + 1:]
        best = max((next((k for k, (x, y) in enumerate(zip(p, o, strict=False)) if x != y),
                         min(len(p), len(o))) for o in others), default=0)
        assert h.bound(p) == best


def _warm(**kw: object) -> WarmState:
    base = dict(warmup_done=True, compile_cache=CompileCacheState.NOT_APPLICABLE,
                request_time_compilation=False,
                prefix_cache_at_start=PrefixCacheStart.WARM_DISJOINT,
                first_request_latency_s=1.0, steady_state_latency_s=1.0)
    base.update(kw)
    return WarmState(**base)  # type: ignore[arg-type]


def _facts(arm: str, **kw: object) -> ArmRunFacts:
    base = dict(completed=10, failed=0, output_tokens=100, cached_beyond_bound=0,
                output_throughput_cv=0.02)
    base.update(kw)
    return ArmRunFacts(arm, **base)  # type: ignore[arg-type]


def test_clean_arms_are_comparable() -> None:
    d = decide([ArmWarmState("a", _warm()), ArmWarmState("b", _warm())],
               [_facts("a"), _facts("b")], {"b/a": [1.0, 1.01, 0.99, 1.0, 1.02]})
    assert d.claim_allowed and d.verdict == "COMPARABLE" and d.reasons == ()


@pytest.mark.parametrize(("facts_b", "warm_b", "ratios", "needle"), [
    ({"cached_beyond_bound": 2}, {}, [1.0] * 5, "cached prompt tokens"),
    ({"failed": 1}, {}, [1.0] * 5, "failed request"),
    ({"failed": 2, "first_error": "ClientOSError: [Errno 104]\nConnection reset"}, {},
     [1.0] * 5, "arm 'b': 2 failed request(s), the first: ClientOSError: [Errno 104] "
                "Connection reset"),
    ({"output_tokens": 99}, {}, [1.0] * 5, "unequal output tokens"),
    ({"completed": 9}, {}, [1.0] * 5, "unequal completed"),
    ({"output_throughput_cv": 0.2}, {}, [1.0] * 5, "CV 20.0%"),
    ({}, {"warmup_done": False}, [1.0] * 5, "warmup_incomplete"),
    ({}, {"prefix_cache_at_start": PrefixCacheStart.CONTAMINATED}, [1.0] * 5, "contaminated"),
    ({}, {"request_time_compilation": None}, [1.0] * 5, "not_observed"),
    ({}, {}, [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7], "drifts over the run"),
])
def test_each_rule_refuses_the_comparison(facts_b: dict, warm_b: dict, ratios: list[float],
                                          needle: str) -> None:
    d = decide([ArmWarmState("a", _warm()), ArmWarmState("b", _warm(**warm_b))],
               [_facts("a"), _facts("b", **facts_b)], {"b/a": ratios})
    assert not d.claim_allowed and d.verdict == "NOT COMPARABLE"
    assert any(needle in r for r in d.reasons), d.reasons


def test_gate_config_is_validated() -> None:
    with pytest.raises(ValueError):
        ABGateConfig(max_cv=0)
    with pytest.raises(ValueError):
        ABGateConfig(drift_p=1.5)
    assert run_reasons([_facts("a"), _facts("b")], ABGateConfig()) == []
