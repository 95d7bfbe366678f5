"""The governor's state: config, driver, secrets, admission, metrics — and the pipeline steps."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from adapters.driver import EngineDriver, Fleet
from governor.admission import Admission, AdmissionRejected, Ticket
from governor.audit.counters import AuditCounters
from governor.audit.entry import AuditLogError
from governor.auth import Authenticator
from governor.config import GovernorConfig, TenantConfig
from governor.errors import GovernorError, bad_request, rate_limited, unavailable
from governor.metrics import GovernorMetrics
from governor.pipeline import ClientSaltRejected, PipelineInputs, Prepared, prepare
from governor.store.protocols import AuditSink, EpochStore, QuarantineStore
from policies.priority import PriorityConfig, admission_rank, engine_priority
from policies.request_fields import FieldRules
from policies.salts import SaltKey, tenant_salt
from schemas.audit import AuditEvent, AuditRecord, AuditState, Evidence
from schemas.openai import RequestInvalid, Route, load_json


class Governor:
    """Everything a request needs, built once at start-up.

    Salts are derived from the key and the tenant's current epoch, read on every request,
    so a rotation takes effect on the very next request; a derived salt is kept in memory
    only beside the epoch it was derived for, and never written anywhere.
    """

    def __init__(self, config: GovernorConfig, driver: EngineDriver, salt_key: SaltKey,
                 epochs: EpochStore, audit: AuditSink) -> None:
        self.config = config
        self.audit = audit
        self.driver = driver
        self.salt_key = salt_key
        self.epochs = epochs
        self.auth = Authenticator(config.tenants, config.server.admin_token_sha256)
        self.priorities = PriorityConfig()
        server = config.server
        self.admission = Admission(server.max_engine_concurrency, server.admission_wait_s,
                                   server.max_queued)
        self.inputs = {t.id: self._inputs(t) for t in config.tenants}
        for t in config.tenants:
            self.admission.set_rate_limits(t.id, t.requests_per_s, t.tokens_per_min)
        self.metrics = GovernorMetrics(driver if isinstance(driver, Fleet) else None)
        self.audit_counters = AuditCounters(config.audit.summary_interval_s, audit.refusal)
        self.quarantine_store: QuarantineStore | None = None  # shared records (postgres)
        self.draining = False
        self._salts: dict[str, tuple[int, str]] = {}  # tenant → (epoch, its salt)

    def _inputs(self, tenant: TenantConfig) -> PipelineInputs:
        server = self.config.server
        rules = FieldRules(allow=frozenset(tenant.allow), unknown_fields=server.unknown_fields,
                           media_url_allowlist=tenant.media_url_allowlist)
        return PipelineInputs(rules, tenant.max_tokens or server.default_max_tokens,
                              server.client_cache_salt)

    def salt_for(self, tenant_id: str) -> str:
        epoch = self.epochs.get(tenant_id)
        known = self._salts.get(tenant_id)
        if known is None or known[0] != epoch:
            known = (epoch, tenant_salt(self.salt_key, tenant_id, epoch))
            if tenant_id in self.inputs:  # configured tenants only: the memo stays bounded
                self._salts[tenant_id] = known
        return known[1]

    def prepare(self, tenant: TenantConfig, route: Route, value: Any,
                request_id: str, body_bytes: int = 0) -> Prepared:
        """The pipeline (governor.pipeline) with this tenant's inputs, salt and priority;
        client salts are counted and audited. `body_bytes`: the raw body's size."""
        caps = self.driver.capabilities
        salt = self.salt_for(tenant.id) if caps.cache_salt else None
        priority = engine_priority(self.priorities, tenant.tenant_class, caps)
        try:
            prepared = prepare(route, value, self.inputs[tenant.id], caps, tenant.id,
                               request_id, salt, priority, body_bytes)
        except ClientSaltRejected:
            self.note_client_salt(tenant.id, "rejected", request_id)
            raise
        if prepared.stripped_salts:
            self.note_client_salt(tenant.id, "stripped", request_id)
        return prepared

    def prepare_raw(self, tenant: TenantConfig, route: Route, raw: bytes,
                    request_id: str) -> Prepared:
        """`prepare` of a raw body (schemas.openai.load_json's rules first)."""
        try:
            value = load_json(raw)
        except RequestInvalid as exc:
            raise bad_request(exc.message, exc.param) from None
        return self.prepare(tenant, route, value, request_id, len(raw))

    def note_client_salt(self, tenant_id: str, action: str, request_id: str) -> None:
        """Counted, and audited as a periodic per-tenant summary (a tenant cannot flood the
        log); 503 while the log refuses appends."""
        self.metrics.client_salts.labels(tenant_id, action).inc()
        self.audit_counters.note(tenant_id, f"client_salt_{action}")

    def reserve(self, tenant: TenantConfig) -> Ticket:
        """A place in the admission queue, before the body is read (429 at once if full)."""
        if self.draining:
            raise unavailable("the governor is shutting down", reason="draining")
        try:
            return self.admission.reserve(tenant.id, tenant.max_concurrency,
                                          admission_rank(self.priorities, tenant.tenant_class),
                                          tenant.queue_limit)
        except AdmissionRejected as rej:
            self.metrics.rejections.labels(tenant.id, rej.reason).inc()
            raise rate_limited(rej.reason, rej.retry_after_s) from None

    async def admit(self, ticket: Ticket) -> float:
        """Wait for the ticket's engine slot; returns the seconds waited."""
        if ticket.granted.done():  # granted at `reserve`: nothing to wait for or time
            return 0.0
        start = time.monotonic()
        try:
            await self.admission.wait(ticket)
        except AdmissionRejected as rej:
            raise rate_limited(rej.reason, rej.retry_after_s) from None
        return time.monotonic() - start

    def release(self, ticket: Ticket, tokens: int = 0) -> None:
        self.admission.charge_tokens(ticket.tenant, tokens)
        self.admission.cancel(ticket)

    async def record(self, event: AuditEvent) -> AuditRecord:
        """Append to the audit log (the writer thread commits it; this awaits durability);
        if that fails nothing may proceed (SEC-18)."""
        try:
            return await self.audit.append_async(event)
        except (AuditLogError, OSError) as exc:
            raise GovernorError(503, f"the audit log cannot be written: {exc}",
                                "server_error", reason="audit_unwritable") from None

    async def rotate(self, tenant_id: str, actor: str) -> AuditRecord:
        """Bump the tenant's epoch: its next request gets a new salt, so nothing it cached
        before is reachable (SEC-10). The `rotate` record is durable before the new epoch is
        visible; when it cannot be written the epoch stays and the answer is 503. Once
        started, a rotation finishes even if the caller goes away."""

        def event_for(old: int, new: int) -> AuditEvent:
            return AuditEvent(kind="rotate", actor=actor, state=AuditState.RECORDED,
                              tenant=tenant_id, plan="salt_rotation",
                              request_id=f"rot-{uuid.uuid4().hex}",
                              evidence=Evidence(old_epoch=old, new_epoch=new))

        old_salt = self.salt_for(tenant_id)
        task = asyncio.ensure_future(self.epochs.rotate(tenant_id, event_for,
                                                        self.audit.append_async))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        try:
            record = await asyncio.shield(task)
        except (AuditLogError, OSError) as exc:
            raise GovernorError(503, f"the audit log cannot be written: {exc}; the epoch is "
                                "unchanged", "server_error", reason="audit_unwritable") from None
        # An engine that can (the native one) ages the old epoch's blocks out of every KV
        # tier first, rather than keep them beside live ones.
        retire = getattr(self.driver, "retire_namespace", None)
        if retire is not None:
            await retire(old_salt)
        return record

    def audit_problem(self) -> str | None:
        """Why the audit log cannot take records now, or the epochs are not confirmed
        (None when all is well), for `/ready`."""
        return self.audit.problem() or self.epochs.problem()

    def audit_ready(self) -> bool:
        return self.audit_problem() is None

    async def flush_audit_summaries(self, force: bool = False) -> int:
        """Write the client-event summaries due now (all with `force`); their count. Counts
        that could not be written are kept for the next try."""
        events = self.audit_counters.pending_summaries(force)
        for n, event in enumerate(events):
            try:
                await self.audit.append_async(event)
            except BaseException:
                self.audit_counters.restore(events[n:])
                raise
        return len(events)

    def tenant_views(self) -> list[dict[str, Any]]:
        return [
            {"id": t.id, "class": t.tenant_class, "epoch": self.epochs.get(t.id),
             "max_concurrency": t.max_concurrency,
             "max_tokens": t.max_tokens or self.config.server.default_max_tokens,
             "in_flight": self.admission.per_tenant(t.id)}
            for t in self.config.tenants
        ]
