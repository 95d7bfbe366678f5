"""Admission: per-tenant concurrency caps and a class-ordered queue for engine slots."""

from __future__ import annotations

import asyncio
import bisect
import itertools
from dataclasses import dataclass, field


class AdmissionRejected(Exception):
    def __init__(self, reason: str, retry_after_s: int) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after_s = retry_after_s


@dataclass(order=True)
class _Waiter:
    rank: int
    seq: int
    tenant: str = field(compare=False)
    cap: int = field(compare=False)
    granted: asyncio.Future[None] = field(compare=False)


class Admission:
    """Grants engine slots in (class rank, arrival) order, never over a tenant's cap.

    Invariants (check_integrity): 0 ≤ in_flight ≤ engine_slots; each tenant's count ≤ its cap;
    the per-tenant counts sum to in_flight; waiters are sorted and none is already granted.
    """

    def __init__(self, engine_slots: int, wait_s: float) -> None:
        if engine_slots < 1 or wait_s < 0:
            raise ValueError("engine_slots must be ≥ 1 and wait_s ≥ 0")
        self.engine_slots = engine_slots
        self.wait_s = wait_s
        self.in_flight = 0
        self.per_tenant: dict[str, int] = {}
        self._caps: dict[str, int] = {}
        self._waiters: list[_Waiter] = []
        self._seq = itertools.count()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self, tenant: str, cap: int, rank: int) -> None:
        """Wait for a slot; raise AdmissionRejected after `wait_s`."""
        waiter = _Waiter(rank, next(self._seq), tenant, cap,
                         asyncio.get_running_loop().create_future())
        bisect.insort(self._waiters, waiter)
        self._dispatch()
        if waiter.granted.done():  # the common case: a slot was free, no timer needed
            return
        try:
            await asyncio.wait_for(asyncio.shield(waiter.granted), self.wait_s)
        except TimeoutError:
            if waiter.granted.done():
                return
            self._waiters.remove(waiter)
            at_cap = self.per_tenant.get(tenant, 0) >= cap
            raise AdmissionRejected(
                "tenant_concurrency" if at_cap else "engine_saturated",
                max(1, round(self.wait_s)),
            ) from None
        except asyncio.CancelledError:
            if waiter.granted.done() and not waiter.granted.cancelled():
                self.release(tenant)
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
            raise

    def release(self, tenant: str) -> None:
        self.in_flight -= 1
        self.per_tenant[tenant] -= 1
        if not self.per_tenant[tenant]:
            del self.per_tenant[tenant]
        self._dispatch()

    def _dispatch(self) -> None:
        for waiter in list(self._waiters):
            if self.in_flight >= self.engine_slots:
                return
            if self.per_tenant.get(waiter.tenant, 0) >= waiter.cap:
                continue
            self._waiters.remove(waiter)
            self.in_flight += 1
            self.per_tenant[waiter.tenant] = self.per_tenant.get(waiter.tenant, 0) + 1
            self._caps[waiter.tenant] = waiter.cap
            waiter.granted.set_result(None)

    def check_integrity(self) -> None:
        assert 0 <= self.in_flight <= self.engine_slots
        assert sum(self.per_tenant.values()) == self.in_flight
        for tenant, count in self.per_tenant.items():
            assert 0 < count <= self._caps[tenant]
        assert self._waiters == sorted(self._waiters)
        assert not any(w.granted.done() for w in self._waiters)
