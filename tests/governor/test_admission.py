from __future__ import annotations

import asyncio

import pytest

from governor.admission import Admission, AdmissionRejected


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
