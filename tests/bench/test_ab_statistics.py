"""The A/B statistics against fake upstreams whose latency distributions are known (real
aiohttp servers on loopback sleeping from seeded log-normals; no model).

Sizes are the smallest that still prove each claim on a busy 2-core machine: 8 blocks of
8 requests per arm at concurrency 8, TTFT medians of 50 ms, σ 0.1 (well above the event
loop's jitter on a loaded machine).
"""

from __future__ import annotations

import time

import pytest

from governor.bench.ab import Measured

from .conftest import RunPair
from .fake_upstream import FakeUpstream, FakeUpstreamConfig

SEEDS = range(20)
TTFT = 0.05


def pair_of(m: Measured):  # type: ignore[no-untyped-def]
    return m.reports[0].pairs[0]


def fake(seed: int, **kw: float) -> FakeUpstreamConfig:
    return FakeUpstreamConfig(ttft_median_s=TTFT, sigma=0.1, seed=seed, **kw)  # type: ignore[arg-type]


@pytest.mark.slow
async def test_identical_arms_interval_contains_one_in_95_percent_of_seeds(
        run_pair: RunPair) -> None:
    contains = []
    for seed in SEEDS:
        m = await run_pair(fake(2 * seed), fake(2 * seed + 1), seed=seed)
        iv = pair_of(m).intervals["ttft.p50"]
        assert iv is not None
        contains.append(iv.contains(1.0))
    assert sum(contains) >= 19, f"interval held 1 in only {sum(contains)} of 20 seeds"


@pytest.mark.slow
async def test_a_30_percent_slower_arm_is_detected_in_95_percent_of_seeds(
        run_pair: RunPair) -> None:
    detected = []
    for seed in SEEDS:
        m = await run_pair(fake(2 * seed), fake(2 * seed + 1, slowdown=1.3), seed=seed)
        iv = pair_of(m).intervals["ttft.p50"]
        assert iv is not None
        detected.append(iv.low > 1.0)
    assert sum(detected) >= 19, f"detected in only {sum(detected)} of 20 seeds"


@pytest.mark.slow
async def test_drift_in_one_arm_is_caught_by_the_interleaving(run_pair: RunPair) -> None:
    """Arm b gets slower as the run goes on: the per-block paired ratio climbs round after
    round, and the comparison is refused for drift."""
    m = await run_pair(fake(1), fake(2, drift_per_s=2.5), blocks=10)
    decision = pair_of(m).decision
    assert not decision.claim_allowed
    assert any("drifts over the run" in r for r in decision.reasons), decision.reasons


@pytest.mark.slow
async def test_a_sequential_run_shows_the_bias_that_interleaving_removes(
        run_pair: RunPair) -> None:
    """The machine slows down during the run (both upstreams drift alike): identical arms
    interleaved keep 1 in the interval; run all-a-then-all-b, b looks slower."""
    def drifting(seed: int, origin: float) -> FakeUpstreamConfig:
        return fake(seed, drift_per_s=1.5, origin=origin)

    origin = time.perf_counter()
    interleaved = await run_pair(drifting(1, origin), drifting(2, origin))
    origin = time.perf_counter()
    sequential = await run_pair(drifting(3, origin), drifting(4, origin), order="sequential")
    iv_i = pair_of(interleaved).intervals["ttft.p50"]
    iv_s = pair_of(sequential).intervals["ttft.p50"]
    assert iv_i is not None and iv_s is not None
    assert iv_i.contains(1.0), iv_i
    assert iv_s.low > 1.0, iv_s
    assert not pair_of(sequential).decision.claim_allowed
    assert any("sequentially" in r for r in pair_of(sequential).decision.reasons)


@pytest.mark.slow
async def test_a_warmed_cold_arm_is_refused(run_pair: RunPair, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Replaying a run's prompts (its run id) against a server that served them: that
    arm's 'cold' requests report cached tokens, so the comparison is refused."""
    a = FakeUpstream(fake(1), tokenizer)
    other = FakeUpstream(fake(2), tokenizer)
    run_id = "feedc0de12345678"
    await run_pair(fake(0), fake(0), upstreams=(a, other), names=("a", "c"), run_id=run_id)
    b = FakeUpstream(fake(3), tokenizer)
    replay = await run_pair(fake(0), fake(0), upstreams=(a, b), run_id=run_id)
    decision = pair_of(replay).decision
    assert not decision.claim_allowed
    cached = [r for r in decision.reasons if "cached prompt tokens" in r]
    assert cached and all("'a'" in r for r in cached), decision.reasons
    assert replay.reports[0].arms["a"].cached_beyond_bound > 0
    assert replay.reports[0].arms["b"].cached_beyond_bound == 0

    fresh = await run_pair(fake(0), fake(0), upstreams=(a, b))
    assert not any("cached prompt tokens" in r for r in pair_of(fresh).decision.reasons)
