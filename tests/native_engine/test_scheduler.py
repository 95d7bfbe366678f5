"""Scheduler semantics (vLLM V1): token budget, chunked prefill, sequence cap, prefix reuse with
partial-block copies, recompute preemption, priority preemption; integrity after every step."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from native_engine.config import EngineConfig
from native_engine.kvcache.block_pool import BlockPool
from native_engine.kvcache.radix_cache import RadixCache
from native_engine.request import Request, RequestStatus, SamplingParams
from native_engine.scheduler import Scheduler, SchedulerOutput


def make(**kw) -> Scheduler:
    cfg = EngineConfig(**{"block_size": 4, "num_blocks": 64, "max_num_batched_tokens": 16, **kw})
    pool = BlockPool(cfg.num_blocks, cfg.block_size)
    return Scheduler(cfg, pool, RadixCache(pool))


_clock = iter(range(10**9))


def req(s: Scheduler, prompt: list[int], max_tokens: int = 4, priority: int = 0,
        rid: str | None = None) -> Request:
    r = Request(rid or f"r{len(prompt)}-{random.random()}", prompt,
                SamplingParams(max_tokens=max_tokens, priority=priority), float(next(_clock)))
    s.add(r)
    return r


def step(s: Scheduler, token: int = 7) -> SchedulerOutput:
    """What the engine does around a forward: advance, sample for completed rows, finish."""
    plan = s.schedule()
    s.advance(plan)
    for r, _ in plan.scheduled:
        if r.num_computed_tokens == r.num_tokens:
            r.token_ids.append(token)
            if r.num_output_tokens >= r.params.max_tokens:
                s.finish(r, RequestStatus.FINISHED_LENGTH)
    s.check_integrity()
    return plan


def sizes(plan: SchedulerOutput) -> list[tuple[str, int]]:
    return [(r.request_id, n) for r, n in plan.scheduled]


def test_budget_running_first_and_chunked_prefill() -> None:
    s = make()
    a, b, c = (req(s, list(range(k, k + 10)), rid=x) for k, x in ((0, "a"), (20, "b"), (40, "c")))
    assert sizes(step(s)) == [("a", 10), ("b", 6)]
    # A partial chunk samples nothing.
    assert b.num_computed_tokens == 6 and b.num_output_tokens == 0
    assert sizes(step(s)) == [("a", 1), ("b", 4), ("c", 10)]
    assert b.num_output_tokens == 1 and c.num_output_tokens == 1 and a.num_output_tokens == 2


def test_budget_exact_accounting() -> None:
    s = make(max_num_batched_tokens=8)
    a = req(s, list(range(5)), rid="a")
    b = req(s, list(range(100, 112)), rid="b")
    assert sizes(step(s)) == [("a", 5), ("b", 3)]
    assert sizes(step(s)) == [("a", 1), ("b", 7)]
    assert sizes(step(s)) == [("a", 1), ("b", 2)]  # b's prefill completes, it samples
    assert b.num_output_tokens == 1 and a.num_output_tokens == 3


def test_no_chunking_waits_for_room_and_seq_cap() -> None:
    s = make(max_num_batched_tokens=16, enable_chunked_prefill=False, max_model_len=16)
    req(s, list(range(8)), rid="a")
    req(s, list(range(100, 112)), rid="b")
    assert sizes(step(s)) == [("a", 8)]  # b (12) does not fit in the 8 left
    assert sizes(step(s)) == [("a", 1), ("b", 12)]
    s2 = make(max_num_seqs=1)
    req(s2, [1, 2], rid="x")
    req(s2, [3, 4], rid="y")
    assert sizes(step(s2)) == [("x", 2)]


def test_prefix_hit_shares_full_blocks_and_copies_partial_tail() -> None:
    s = make(max_num_batched_tokens=64)
    prompt = list(range(1, 23))  # 22 tokens: blocks of 4 -> 5 full + 2
    first = req(s, prompt, max_tokens=1, rid="first")
    step(s)
    assert first.is_finished
    second = req(s, [*prompt[:18], 99, 98], max_tokens=2, rid="second")
    plan = step(s)
    assert second.num_cached_tokens == 18  # not rounded down to 16
    assert sizes(plan) == [("second", 2)]
    bs = 4
    cached = s.cache.match(None, [*prompt, 0]).slots
    assert second.block_table[:4] == [cached[k * bs] // bs for k in range(4)]  # shared
    assert plan.copy_src == cached[16:18]
    assert plan.copy_dst == [second.block_table[4] * bs, second.block_table[4] * bs + 1]
    assert s.stats.prefix_hit_tokens == 18 and s.stats.prefix_query_tokens == 22 + 20
    # A block-aligned full hit still computes the last token (never a zero-token step).
    third = req(s, prompt[:16], max_tokens=1, rid="third")
    plan = step(s)
    assert third.num_cached_tokens == 15 and sizes(plan)[-1] == ("third", 1)


def test_namespaces_do_not_share_hits() -> None:
    s = make()
    a = Request("a", list(range(12)), SamplingParams(max_tokens=1, namespace="t1"), 0.0)
    s.add(a)
    step(s)
    b = Request("b", list(range(12)), SamplingParams(max_tokens=1, namespace="t2"), 1.0)
    s.add(b)
    step(s)
    assert b.num_cached_tokens == 0
    c = Request("c", list(range(12)), SamplingParams(max_tokens=1, namespace="t1"), 2.0)
    s.add(c)
    step(s)
    assert c.num_cached_tokens == 11


def test_recompute_preemption_when_blocks_run_out_fcfs() -> None:
    s = make(num_blocks=6, max_num_batched_tokens=32)
    a = req(s, list(range(8)), max_tokens=12, rid="a")
    b = req(s, list(range(50, 58)), max_tokens=12, rid="b")
    step(s)  # 2 + 2 blocks
    preempted = []
    for _ in range(40):
        if not s.has_unfinished():
            break
        preempted += [r.request_id for r in step(s).preempted]
    assert preempted and preempted[0] == "b"  # FCFS: the last admitted goes first
    assert a.is_finished and b.is_finished
    assert a.num_output_tokens == b.num_output_tokens == 12
    assert b.num_preemptions >= 1 and s.stats.num_preemptions == len(preempted)
    assert b.num_cached_tokens == 0  # the usage figure is the first admission's


def test_priority_preemption_by_memory_takes_worst_priority() -> None:
    s = make(num_blocks=6, max_num_batched_tokens=32, scheduling_policy="priority")
    low = req(s, list(range(8)), max_tokens=12, priority=5, rid="low")
    high = req(s, list(range(50, 58)), max_tokens=12, priority=1, rid="high")
    first = step(s)
    assert [r.request_id for r, _ in first.scheduled] == ["high", "low"]
    victims = []
    while s.has_unfinished():
        victims += [r.request_id for r in step(s).preempted]
    assert victims and set(victims) == {"low"}
    assert high.is_finished and low.is_finished and high.num_preemptions == 0


def test_waiting_higher_priority_preempts_running_lower() -> None:
    s = make(max_num_seqs=1, scheduling_policy="priority")
    low = req(s, list(range(6)), max_tokens=8, priority=3, rid="low")
    step(s)
    step(s)
    assert low.status is RequestStatus.RUNNING and low.num_output_tokens == 2
    high = req(s, list(range(40, 46)), max_tokens=2, priority=0, rid="high")
    plan = step(s)
    assert [r.request_id for r in plan.preempted] == ["low"]
    assert sizes(plan) == [("high", 6)]
    assert low.status is RequestStatus.PREEMPTED and low.num_computed_tokens == 0
    step(s)
    assert high.is_finished
    hits = s.stats.prefix_hit_tokens
    plan = step(s)  # low comes back; the KV it had computed was cached at preemption
    assert sizes(plan) == [("low", 1)] and s.stats.prefix_hit_tokens - hits == 7
    assert low.num_output_tokens == 3 and low.num_cached_tokens == 0
    while s.has_unfinished():
        step(s)
    assert low.num_output_tokens == 8


def test_equal_priority_does_not_preempt() -> None:
    s = make(max_num_seqs=1, scheduling_policy="priority")
    req(s, [1, 2, 3], max_tokens=4, priority=2, rid="a")
    step(s)
    req(s, [4, 5, 6], max_tokens=4, priority=2, rid="b")
    assert not step(s).preempted


def test_abort_waiting_and_running_frees_everything() -> None:
    s = make()
    a = req(s, list(range(10)), rid="a")
    b = req(s, list(range(20, 40)), rid="b")
    step(s)
    s.finish(a, RequestStatus.FINISHED_ABORTED)
    s.finish(b, RequestStatus.FINISHED_ABORTED)
    s.check_integrity()
    assert not s.has_unfinished() and not s.running
    assert s.cache.reset()
    assert s.pool.num_free == s.pool.num_blocks


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    policy=st.sampled_from(["fcfs", "priority"]),
    num_blocks=st.integers(8, 24),
    budget=st.integers(4, 24),
)
def test_random_workloads_finish_and_keep_integrity(
    seed: int, policy: str, num_blocks: int, budget: int
) -> None:
    rng = random.Random(seed)
    s = make(num_blocks=num_blocks, max_num_batched_tokens=budget, scheduling_policy=policy,
             max_num_seqs=rng.randint(1, 6), max_model_len=32)
    reqs = []
    for i in range(rng.randint(1, 10)):
        prompt = [rng.randint(0, 3) for _ in range(rng.randint(1, 20))]
        ns = rng.choice([None, "x"])
        r = Request(f"q{i}", prompt, SamplingParams(
            max_tokens=rng.randint(1, 32 - len(prompt)), namespace=ns,
            priority=rng.randint(0, 3) if policy == "priority" else 0), float(i))
        s.add(r)
        reqs.append(r)
    for _ in range(500):
        if not s.has_unfinished():
            break
        if rng.random() < 0.05:
            live = [r for r in reqs if not r.is_finished]
            s.finish(rng.choice(live), RequestStatus.FINISHED_ABORTED)
            s.check_integrity()
            continue
        step(s, token=rng.randint(0, 3))
    assert not s.has_unfinished()
    for r in reqs:
        assert r.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)
        if r.status is RequestStatus.FINISHED_LENGTH:
            assert r.num_output_tokens == r.params.max_tokens
    assert s.cache.reset() and s.pool.num_free == num_blocks
