from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from governor.admission import Admission, AdmissionRejected, Ticket


async def test_caps_and_class_order() -> None:
    adm = Admission(engine_slots=2, wait_s=5)
    await adm.acquire("a", cap=1, rank=1)
    await adm.acquire("b", cap=4, rank=1)
    adm.check_integrity()
    order: list[str] = []

    async def wait(tenant: str, rank: int) -> None:
        await adm.acquire(tenant, cap=4, rank=rank)
        order.append(tenant)

    batch = asyncio.create_task(wait("batch", 2))
    await asyncio.sleep(0)
    interactive = asyncio.create_task(wait("inter", 0))
    await asyncio.sleep(0)
    assert adm.waiting == 2
    adm.release("a")
    await asyncio.sleep(0)
    adm.release("b")
    await asyncio.gather(batch, interactive)
    assert order == ["inter", "batch"]
    adm.check_integrity()


async def test_tenant_cap_does_not_block_others() -> None:
    adm = Admission(engine_slots=4, wait_s=5)
    await adm.acquire("a", cap=1, rank=0)
    blocked = asyncio.create_task(adm.acquire("a", cap=1, rank=0))
    await asyncio.sleep(0)
    await asyncio.wait_for(adm.acquire("b", cap=1, rank=2), 1)
    assert not blocked.done()
    adm.release("a")
    await asyncio.wait_for(blocked, 1)
    adm.check_integrity()


async def test_bounded_wait_rejects_with_reason() -> None:
    adm = Admission(engine_slots=1, wait_s=0.05)
    await adm.acquire("a", cap=1, rank=0)
    with pytest.raises(AdmissionRejected) as exc:
        await adm.acquire("a", cap=1, rank=0)
    assert exc.value.reason == "tenant_concurrency" and exc.value.retry_after_s >= 1
    with pytest.raises(AdmissionRejected) as exc:
        await adm.acquire("b", cap=1, rank=0)
    assert exc.value.reason == "engine_saturated"
    assert adm.waiting == 0
    adm.check_integrity()


async def test_cancelled_waiter_leaves_no_trace() -> None:
    adm = Admission(engine_slots=1, wait_s=5)
    await adm.acquire("a", cap=2, rank=0)
    task = asyncio.create_task(adm.acquire("b", cap=2, rank=0))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    adm.release("a")
    assert adm.in_flight == 0 and adm.waiting == 0
    adm.check_integrity()


async def test_a_free_slot_is_granted_at_once_only_when_nobody_waits() -> None:
    adm = Admission(engine_slots=2, wait_s=5)
    first = adm.reserve("a", cap=1, rank=0, max_queued=4)
    assert first.granted.done() and adm.in_flight == 1  # granted in `reserve` itself
    held = adm.reserve("a", cap=1, rank=0, max_queued=4)  # a's cap: it queues
    assert not held.granted.done() and adm.waiting == 1
    other = adm.reserve("b", cap=1, rank=1, max_queued=4)  # b is below its cap, a slot free
    assert other.granted.done() and adm.in_flight == 2
    adm.check_integrity()
    adm.cancel(first)  # a's slot back: its waiter, not a newcomer, gets it
    assert held.granted.done() and adm.waiting == 0
    adm.cancel(held)
    adm.cancel(other)
    assert adm.in_flight == 0
    adm.check_integrity()


TENANTS = {"a": (1, 0), "b": (2, 1), "c": (3, 2)}  # name: (cap, rank)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.sampled_from(sorted(TENANTS)),
                              st.integers(0, 7)), max_size=40))
def test_admission_never_idles_a_slot_someone_may_take(
        ops: list[tuple[bool, str, int]]) -> None:
    """Random reserves and cancels on 3 slots: after each, the invariants hold and no live
    waiter could take a free slot (its tenant below its cap)."""

    async def run() -> None:
        adm = Admission(engine_slots=3, wait_s=5)
        tickets: list[Ticket] = []
        for reserve, tenant, pick in ops:
            if reserve or not tickets:
                cap, rank = TENANTS[tenant]
                tickets.append(adm.reserve(tenant, cap, rank, max_queued=8))
            else:
                adm.cancel(tickets.pop(pick % len(tickets)))
            adm.check_integrity()
            running = {name: sum(t.granted.done() and not t.cancelled and t.tenant == name
                                 for t in tickets) for name in TENANTS}
            assert sum(running.values()) == adm.in_flight
            assert all(running[name] <= TENANTS[name][0] for name in TENANTS)
            if adm.in_flight < adm.engine_slots:
                assert not any(t.waiting and running[t.tenant] < TENANTS[t.tenant][0]
                               for t in tickets)
        for ticket in tickets:
            adm.cancel(ticket)
        assert adm.in_flight == 0 and adm.waiting == 0
        adm.check_integrity()

    asyncio.run(run())
