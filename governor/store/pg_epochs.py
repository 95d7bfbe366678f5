"""Tenant epochs shared by every replica: read from memory on the request path, changed
only by compare-and-set in the database, and refused past the staleness bound.

`get` never touches the database: it reads the watcher's epochs, and answers 503 when the
watcher has not confirmed them within `[state] epoch_max_staleness_ms` (fail closed rather
than derive a salt from an epoch that may be old). `rotate` commits the compare-and-set and
its `rotate` record in one transaction (governor.store.pg_audit), uses the new epoch here at
once, then waits up to the bound for every live replica to acknowledge it, and records the
outcome as `rotation_confirmed`: VERIFIED when all did, UNVERIFIED naming each replica that
missed the bound (`replica_missed=<id>`). A replica that missed it cannot serve the old salt
beyond the bound either: it stops confirming, and so stops serving.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from governor.errors import GovernorError
from governor.store.pg_audit import PgAuditLog
from governor.store.watcher import EpochWatcher
from schemas.audit import AuditEvent, AuditRecord, AuditState, Evidence

ACK_POLL_S = 0.005


class EpochsStale(GovernorError):
    """This replica could not confirm the epochs within the bound."""


class PgEpochs:
    def __init__(self, audit: PgAuditLog, watcher: EpochWatcher) -> None:
        self.audit = audit
        self.watcher = watcher

    def get(self, tenant: str) -> int:
        age = self.watcher.age_s()
        if age > self.watcher.bound_s:
            raise EpochsStale(503, f"tenant epochs not confirmed for {_ms(age)} (bound "
                              f"{_ms(self.watcher.bound_s)}): the state database is "
                              f"unreachable; refusing rather than using a stale salt",
                              type="server_error", reason="epochs_stale")
        return self.watcher.epoch(tenant)

    def problem(self) -> str | None:
        age = self.watcher.age_s()
        if age > self.watcher.bound_s:
            return (f"tenant epochs not confirmed for {_ms(age)} (bound "
                    f"{_ms(self.watcher.bound_s)}): the state database is unreachable")
        return None

    async def rotate(self, tenant: str, event_for: Callable[[int, int], AuditEvent],
                     append: Callable[[AuditEvent], Awaitable[AuditRecord]]) -> AuditRecord:
        """Compare-and-set and record atomically, then confirm across replicas (see the
        module). `append` writes the confirmation."""
        rotation = await asyncio.wrap_future(self.audit.submit_rotate(tenant, event_for))
        record = rotation.record
        live = (rotation.live or self.watcher.live_replicas()) | {self.watcher.replica}
        evidence = record.event.evidence
        assert evidence is not None and evidence.new_epoch is not None
        self.watcher.apply(tenant, evidence.new_epoch)
        missed = await self._wait_acks(tenant, evidence.new_epoch, live)
        reasons = (f"replicas_acked={len(live) - len(missed)}/{len(live)}",
                   *(f"replica_missed={r}" for r in sorted(missed)))
        return await append(AuditEvent(
            kind="rotation_confirmed", actor=record.event.actor,
            state=AuditState.UNVERIFIED if missed else AuditState.VERIFIED, tenant=tenant,
            plan="salt_rotation", reasons=reasons, request_id=record.event.request_id,
            evidence=Evidence(old_epoch=evidence.old_epoch, new_epoch=evidence.new_epoch)))

    async def _wait_acks(self, tenant: str, epoch: int, live: frozenset[str]) -> set[str]:
        deadline = time.monotonic() + self.watcher.bound_s
        while True:
            missed = {r for r in live if self.watcher.acked(r, tenant) < epoch}
            if not missed or time.monotonic() >= deadline:
                return missed
            await asyncio.sleep(ACK_POLL_S)

    def close(self) -> None:
        self.watcher.stop()


def _ms(seconds: float) -> str:
    return "since start-up" if seconds == float("inf") else f"{seconds * 1000:.0f} ms"
