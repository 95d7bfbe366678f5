"""Value-aware eviction: cost order, protection of pinned/in-use spans, LRU on uniform input."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.eviction import (
    EvictionCandidate,
    RestoreRates,
    choose_victims,
    eviction_value,
    restore_cost_tokens,
    restore_pays,
    reuse_probability,
)


def cand(key: str, last_use: float, tokens: int = 16, size: int = 1024, hits: int = 0, **kw):
    return EvictionCandidate(key, tokens, size, hits, last_use, **kw)


def test_laplace_reuse_probability() -> None:
    assert reuse_probability(0, 0) == pytest.approx(0.5)
    assert reuse_probability(3, 8) == pytest.approx(0.4)
    with pytest.raises(ValueError):
        reuse_probability(5, 4)


def test_value_formula() -> None:
    c = cand("a", 0.0, tokens=100, size=400, hits=3)
    assert eviction_value(c, 8) == pytest.approx(100 * 0.4 / 400)


def test_cheapest_first_then_oldest() -> None:
    cands = [
        cand("hot", 1.0, hits=9),
        cand("cold-new", 5.0, hits=0),
        cand("cold-old", 2.0, hits=0),
        cand("big-cheap", 9.0, tokens=16, size=8192, hits=9),
    ]
    choice = choose_victims(cands, bytes_needed=1, total_accesses=20)
    assert choice.victims == ("cold-old",)
    choice = choose_victims(cands, bytes_needed=10**6)
    assert choice.victims == ("cold-old", "cold-new", "big-cheap", "hot")
    assert not choice.satisfied and choice.bytes_freed == 1024 * 3 + 8192


def test_stops_once_enough_bytes_are_freed() -> None:
    cands = [cand(str(i), float(i)) for i in range(10)]
    choice = choose_victims(cands, bytes_needed=2048)
    assert choice.victims == ("0", "1") and choice.satisfied and choice.bytes_freed == 2048
    choice = choose_victims(cands, bytes_needed=2049)
    assert choice.victims == ("0", "1", "2")


def test_pinned_and_in_use_are_never_victims() -> None:
    cands = [cand("pinned", 0.0, pinned=True), cand("busy", 0.0, in_use=True), cand("ok", 9.0)]
    choice = choose_victims(cands, bytes_needed=10**6)
    assert choice.victims == ("ok",) and not choice.satisfied


def test_nothing_needed_or_nothing_available() -> None:
    assert choose_victims([cand("a", 0.0)], 0).victims == ()
    empty = choose_victims([], 10)
    assert empty.victims == () and not empty.satisfied


@pytest.mark.parametrize(
    "kwargs",
    [{"size": 0}, {"tokens": -1}, {"hits": -1}, {"size": 1.5}, {"hits": True}],
)
def test_bad_candidate_is_refused(kwargs: dict) -> None:
    with pytest.raises((TypeError, ValueError)):
        cand("x", 0.0, **kwargs)


uniform = st.tuples(st.integers(1, 512), st.integers(1, 1 << 20), st.integers(0, 100)).flatmap(
    lambda shape: st.lists(
        st.tuples(st.floats(0, 1e6, allow_nan=False), st.booleans(), st.booleans()),
        max_size=40,
    ).map(
        lambda rows: [
            EvictionCandidate(i, shape[0], shape[1], shape[2], t, pinned=p, in_use=u)
            for i, (t, p, u) in enumerate(rows)
        ]
    )
)


@settings(max_examples=200, deadline=None)
@given(cands=uniform, need_blocks=st.integers(0, 45))
def test_uniform_inputs_reduce_to_lru(cands: list[EvictionCandidate], need_blocks: int) -> None:
    size = cands[0].bytes if cands else 1
    choice = choose_victims(cands, need_blocks * size)
    evictable = [c for c in cands if not (c.pinned or c.in_use)]
    lru = [c.key for c in sorted(evictable, key=lambda c: c.last_use)]
    assert list(choice.victims) == lru[: min(need_blocks, len(lru))]


general = st.lists(
    st.builds(
        EvictionCandidate,
        key=st.uuids(),
        tokens=st.integers(0, 4096),
        bytes=st.integers(1, 1 << 24),
        hits=st.integers(0, 50),
        last_use=st.floats(0, 1e6, allow_nan=False),
        pinned=st.booleans(),
        in_use=st.booleans(),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(cands=general, need=st.integers(0, 1 << 26))
def test_victims_are_evictable_cheapest_and_minimal(
    cands: list[EvictionCandidate], need: int
) -> None:
    choice = choose_victims(cands, need)
    by_key = {c.key: c for c in cands}
    victims = [by_key[k] for k in choice.victims]
    assert all(not (v.pinned or v.in_use) for v in victims)
    assert choice.bytes_freed == sum(v.bytes for v in victims)
    evictable_bytes = sum(c.bytes for c in cands if not (c.pinned or c.in_use))
    assert choice.satisfied is (choice.bytes_freed >= need or need <= 0)
    assert choice.satisfied or choice.bytes_freed == evictable_bytes
    if victims:
        assert sum(v.bytes for v in victims[:-1]) < need  # no victim beyond what was needed
    total = max((c.hits for c in cands), default=0)
    kept = [c for c in cands if c.key not in choice.victims and not (c.pinned or c.in_use)]
    worst_victim = max((eviction_value(v, total) for v in victims), default=None)
    if worst_victim is not None and kept:
        assert worst_victim <= min(eviction_value(c, total) for c in kept)


# --- restore or recompute ---------------------------------------------------------------


def test_restore_cost_is_the_transfer_time_in_prefill_tokens() -> None:
    rates = RestoreRates(200.0, {"CPU": 1e9, "DISK": 1e8})
    assert restore_cost_tokens(737_280, "CPU", rates) == pytest.approx(737_280 / 1e9 * 200)
    assert restore_pays(16, 737_280, "CPU", rates) and restore_pays(16, 737_280, "DISK", rates)
    assert restore_cost_tokens(1, "NVME", rates) == float("inf")
    assert not restore_pays(16, 1, "NVME", rates)  # no measured rate: never restored


def test_a_tier_slower_than_recompute_does_not_pay() -> None:
    # A tiny model prefills 50k tokens/s; 16 tokens take 0.32 ms, a 1 MB read at 100 MB/s 10 ms.
    rates = RestoreRates(50_000.0, {"DISK": 1e8})
    assert not restore_pays(16, 1_000_000, "DISK", rates)
    assert restore_pays(16, 10_000, "DISK", rates)


@pytest.mark.parametrize("kwargs", [
    {"prefill_tokens_per_s": 0.0}, {"prefill_tokens_per_s": float("nan")},
    {"prefill_tokens_per_s": True}, {"restore_bytes_per_s": {"CPU": -1.0}},
    {"restore_bytes_per_s": {"CPU": float("inf")}},
])
def test_bad_rates_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        RestoreRates(**{"prefill_tokens_per_s": 1.0, **kwargs})


def test_restore_cost_lowers_the_value_of_keeping() -> None:
    """Keeping a copy saves recompute minus restore: a slow restore saves little."""
    slow = cand("slow", 0.0, restore_cost=12.0)
    fast = cand("fast", 1.0, restore_cost=2.0)
    assert eviction_value(slow, 0) < eviction_value(fast, 0)
    assert choose_victims([fast, slow], 1).victims == ("slow",)
    assert eviction_value(cand("free", 0.0, restore_cost=99.0), 0) == 0.0
    with pytest.raises(ValueError):
        cand("bad", 0.0, restore_cost=float("inf"))
