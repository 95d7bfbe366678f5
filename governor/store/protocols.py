"""What the governor needs from its state, whichever backend keeps it (file or postgres)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import Any, Protocol

from schemas.audit import AuditEvent, AuditRecord, SignedCheckpoint


class AuditSink(Protocol):
    """The audit log: governor.audit.log.AuditLog or governor.store.pg_audit.PgAuditLog."""

    epochs_at_open: dict[str, int]

    @property
    def size(self) -> int: ...

    @property
    def latest_checkpoint(self) -> SignedCheckpoint | None: ...

    def submit(self, event: AuditEvent) -> Future[AuditRecord]: ...

    def append(self, event: AuditEvent) -> AuditRecord: ...

    async def append_async(self, event: AuditEvent) -> AuditRecord: ...

    def refusal(self) -> str | None: ...

    def problem(self) -> str | None: ...

    async def maintain_async(self) -> SignedCheckpoint | None: ...

    def close(self) -> None: ...

    def check_integrity(self) -> None: ...


class EpochStore(Protocol):
    """Tenant epochs: governor.secrets.TenantEpochs or governor.store.pg_epochs.PgEpochs."""

    def get(self, tenant: str) -> int: ...

    def problem(self) -> str | None: ...

    async def rotate(self, tenant: str, event_for: Callable[[int, int], AuditEvent],
                     append: Callable[[AuditEvent], Awaitable[AuditRecord]]) -> AuditRecord: ...

    def close(self) -> None: ...


class QuarantineStore(Protocol):
    """Quarantine records shared between replicas (postgres only)."""

    async def put(self, quarantine_id: str, tenant: str, audit_index: int,
                  doc: dict[str, Any]) -> None: ...

    async def get(self, quarantine_id: str) -> dict[str, Any] | None: ...

    def close(self) -> None: ...
