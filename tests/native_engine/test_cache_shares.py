"""Capacity isolation (SEC-9): a cache group's reserved share of cached blocks survives
another group's flood; the group still evicts its own blocks; counts stay exact. On the
real engine (tiny model) and through the governor, a tenant's cached prefix outlives a
flood by another tenant when it has a `cache_share`, and does not without one."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from native_engine.config import EngineConfig
from native_engine.engine import LLMEngine
from native_engine.kvcache.block_pool import BlockPool
from native_engine.kvcache.radix_cache import RadixCache
from native_engine.request import SamplingParams
from tests.native_engine.tiny_model import random_model

B = 4


def fill(pool: BlockPool, cache: RadixCache, ns: str, group: str, tokens: list[int]) -> None:
    table = pool.allocate(pool.blocks_for(len(tokens)))
    cache.insert(ns, tokens, pool.slots(table, 0, len(tokens)), group)
    pool.decref(table)


def test_flood_never_evicts_a_group_below_its_reservation() -> None:
    pool = BlockPool(32, B)
    cache = RadixCache(pool)
    cache.reserve("a", 8)
    fill(pool, cache, "salt-a", "a", list(range(100, 132)))  # 8 blocks
    rng = random.Random(1)
    for _ in range(40):  # b floods with distinct prompts
        need = 6
        if pool.num_free < need:
            cache.evict(need - pool.num_free, "b")
        if pool.num_free < need:
            break
        fill(pool, cache, "salt-b", "b", [rng.randrange(1000) for _ in range(need * B)])
        assert cache.group_blocks("a") == 8
        cache.check_integrity([], {})
    assert cache.match("salt-a", [*range(100, 132), 0]).length == 32
    # The owner itself may evict its own blocks.
    assert cache.evict(pool.num_blocks, "a") > 0
    assert cache.group_blocks("a") < 8
    cache.check_integrity([], {})


def test_without_a_reservation_the_flood_wins() -> None:
    pool = BlockPool(32, B)
    cache = RadixCache(pool)
    fill(pool, cache, "salt-a", "a", list(range(100, 132)))
    rng = random.Random(2)
    for _ in range(40):
        if pool.num_free < 6:
            cache.evict(6 - pool.num_free, "b")
        fill(pool, cache, "salt-b", "b", [rng.randrange(1000) for _ in range(24)])
    assert cache.match("salt-a", [*range(100, 132), 0]).length == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(1, 12)),
                min_size=1, max_size=60), st.integers(0, 10))
def test_counts_stay_exact_and_reservations_hold(ops: list[tuple[str, int]],
                                                 reserve_a: int) -> None:
    pool = BlockPool(24, B)
    cache = RadixCache(pool)
    cache.reserve("a", reserve_a)
    rng = random.Random(0)
    for group, length in ops:
        before = cache.group_blocks("a")
        need = pool.blocks_for(length)
        if pool.num_free < need:
            cache.evict(need - pool.num_free, group)
        if group != "a":
            assert cache.group_blocks("a") >= min(before, reserve_a)
        if pool.num_free >= need:
            fill(pool, cache, f"salt-{group}", group, [rng.randrange(50) for _ in range(length)])
        cache.check_integrity([], {})


def test_config_validates_shares() -> None:
    assert EngineConfig(num_blocks=100, cache_shares=(("a", 0.25),)).reserved_blocks() == {
        "a": 25}
    for bad in ((("a", 0.0),), (("a", 1.5),), (("a", 0.6), ("b", 0.6)),
                (("a", 0.1), ("a", 0.1))):
        with pytest.raises(ValueError):
            EngineConfig(cache_shares=bad)


def engine_with(shares: tuple[tuple[str, float], ...]) -> LLMEngine:
    config = EngineConfig(num_blocks=48, block_size=8, max_model_len=256,
                          max_num_batched_tokens=256, cache_shares=shares)
    return LLMEngine.from_config(config, loaded=random_model(seed=7))


def cached_after_flood(engine: LLMEngine) -> int:
    """A caches a 64-token prompt; B floods with 24 distinct 96-token prompts; A again."""
    rng = random.Random(3)
    prompt = [rng.randrange(3, 259) for _ in range(64)]
    a = SamplingParams(max_tokens=1, temperature=0, namespace="salt-a", cache_group="a")
    engine.generate([prompt], a)
    for _ in range(24):
        flood = [rng.randrange(3, 259) for _ in range(96)]
        engine.generate([flood], SamplingParams(max_tokens=1, temperature=0,
                                                namespace="salt-b", cache_group="b"))
    engine.check_integrity()
    return engine.generate([prompt], a)[0].cached_tokens


def test_on_the_engine_a_share_keeps_a_prefix_through_a_flood() -> None:
    assert cached_after_flood(engine_with((("a", 0.25),))) >= 56
    assert cached_after_flood(engine_with(())) == 0
