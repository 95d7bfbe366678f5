"""The isolation audit's pure parts: prompts, schedule, statistics (the KS direction above
all) and the verdict."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.isolation_audit import (
    LETTERS,
    VERDICT_CONTROL_FAILED,
    VERDICT_LEAK,
    VERDICT_NO_SIGNAL,
    PhaseStats,
    Thresholds,
    Trial,
    phase_stats,
    prefix_sharing_prompt,
    random_prompt,
    schedule,
    verdict,
)


def test_random_prompt_is_letters_one_per_token_and_seeded() -> None:
    prompt = random_prompt(random.Random(7), 300)
    tokens = prompt.split(" ")
    assert len(tokens) == 300 and all(len(t) == 1 and t in LETTERS for t in tokens)
    assert prompt == random_prompt(random.Random(7), 300)
    assert prompt != random_prompt(random.Random(8), 300)


@given(seed=st.integers(0, 2**32), n=st.integers(2, 400), fraction=st.floats(0.01, 0.99))
def test_prefix_sharing_prompt_shares_exactly_the_prefix(seed: int, n: int,
                                                         fraction: float) -> None:
    rng = random.Random(seed)
    planted = random_prompt(rng, n)
    probe = prefix_sharing_prompt(rng, planted, fraction)
    a, b = planted.split(" "), probe.split(" ")
    keep = round(n * fraction)
    assert len(b) == n and all(len(t) == 1 and t in LETTERS for t in b)
    assert b[:keep] == a[:keep]
    if keep < n:
        assert b[keep] != a[keep]  # the shared prefix is exactly `keep` tokens


def test_schedule_has_every_trial_kind_equally_in_random_order() -> None:
    trials = schedule(random.Random(1), 25)
    assert Counter(trials) == {Trial(p, k): 25 for p in ("cross", "control")
                               for k in ("hit", "miss")}
    assert trials == schedule(random.Random(1), 25)
    assert trials != sorted(trials, key=lambda t: (t.phase, t.kind))
    with pytest.raises(ValueError):
        schedule(random.Random(1), 0)


def test_hits_faster_than_misses_give_a_small_p() -> None:
    """The direction: fast hits are a stochastically smaller TTFT, which scipy's one-sided
    alternative "greater" (the hit CDF above the miss CDF) detects."""
    hit = [0.010 + 0.001 * i for i in range(20)]
    miss = [0.100 + 0.001 * i for i in range(20)]
    fast = phase_stats(hit, miss)
    assert fast.p_value < 1e-10 and fast.ks_statistic == 1.0 and fast.share_faster == 1.0
    assert fast.median_ratio == pytest.approx(0.1095 / 0.0195)
    slow = phase_stats(miss, hit)  # hits slower than misses: no evidence of caching
    assert slow.p_value == pytest.approx(1.0) and slow.share_faster == 0.0


@given(seed=st.integers(0, 2**32))
def test_p_is_a_probability_and_faster_hits_never_raise_it(seed: int) -> None:
    rng = random.Random(seed)
    hit = [rng.uniform(0.1, 0.2) for _ in range(30)]
    miss = [rng.uniform(0.1, 0.2) for _ in range(30)]
    same = phase_stats(hit, miss)
    assert 0.0 <= same.p_value <= 1.0 and 0.0 <= same.ks_statistic <= 1.0
    assert 0.0 <= same.share_faster <= 1.0
    faster = phase_stats([t - 0.05 for t in hit], miss)
    assert faster.p_value <= same.p_value and faster.ks_statistic >= same.ks_statistic


def test_share_faster_counts_hits_below_the_fastest_miss() -> None:
    stats = phase_stats([0.1, 0.2, 0.5, 0.9], [0.3, 0.4, 0.6])
    assert stats.share_faster == 0.5 and stats.n_hit == 4 and stats.n_miss == 3


@pytest.mark.parametrize("bad", [([], [1.0]), ([1.0], []), ([float("nan")], [1.0]),
                                 ([-1.0], [1.0])])
def test_phase_stats_refuses_bad_samples(bad: tuple[list[float], list[float]]) -> None:
    with pytest.raises(ValueError):
        phase_stats(*bad)


def stats(p: float) -> PhaseStats:
    return PhaseStats(10, 10, 0.1, 0.2, 2.0, 0.5, p, 0.5)


@pytest.mark.parametrize(("cross", "control", "expected"), [
    (0.5, 1e-9, VERDICT_NO_SIGNAL),
    (0.01, 1e-9, VERDICT_NO_SIGNAL),  # p = alpha is not below it
    (0.0099, 1e-9, VERDICT_LEAK),
    (1e-9, 0.5, VERDICT_LEAK),  # a positive finding stands without the control
    (0.5, 1e-6, VERDICT_CONTROL_FAILED),  # the control must be below control_alpha
    (0.5, 0.5, VERDICT_CONTROL_FAILED),
])
def test_verdict(cross: float, control: float, expected: str) -> None:
    assert verdict(stats(cross), stats(control), Thresholds()) == expected


@pytest.mark.parametrize("bad", [{"alpha": 0}, {"alpha": 1}, {"control_alpha": float("nan")},
                                 {"control_alpha": -1e-6}])
def test_thresholds_are_probabilities(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Thresholds(**bad)
