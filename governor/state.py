"""The governor's state: config, driver, secrets, admission, metrics — and the pipeline steps."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from adapters.driver import EngineDriver
from governor.admission import Admission
from governor.audit.counters import AuditCounters
from governor.audit.entry import AuditLogError
from governor.auth import Authenticator
from governor.config import GovernorConfig, TenantConfig
from governor.http.validation import bad_request
from governor.metrics import GovernorMetrics
from governor.store.protocols import AuditSink, EpochStore, QuarantineStore
from policies.priority import PriorityConfig, admission_rank, engine_priority
from policies.salts import SaltKey, find_client_salts, strip_client_salts, tenant_salt
from schemas.audit import AuditEvent, AuditRecord, AuditState, Evidence
from schemas.engine import EngineError, EngineRequest


class Governor:
    """Everything a request needs, built once at start-up.

    Salts are derived per request from the key and the tenant's current epoch, so a rotation
    takes effect on the very next request and no salt is ever stored.
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
        self.admission = Admission(config.server.max_engine_concurrency,
                                   config.server.admission_wait_s)
        self.metrics = GovernorMetrics()
        self.audit_counters = AuditCounters(config.audit.summary_interval_s, audit.refusal)
        self.quarantine_store: QuarantineStore | None = None  # shared records (postgres)
        self.draining = False

    def salt_for(self, tenant_id: str) -> str:
        return tenant_salt(self.salt_key, tenant_id, self.epochs.get(tenant_id))

    def prepare(self, tenant: TenantConfig, route: str, body: dict[str, Any],
                request_id: str) -> tuple[EngineRequest, bool]:
        """Client salt policy, governor salt, priority. Returns the request and whether the
        client asked for the usage chunk (the governor always asks upstream, to account)."""
        caps = self.driver.capabilities
        if body.get("model") not in (None, caps.model_id):
            raise EngineError(404, f"The model `{body['model']}` does not exist.",
                              type="NotFoundError", param="model")
        if find_client_salts(body):
            action = {"reject": "rejected", "strip": "stripped"}[
                self.config.server.client_cache_salt]
            self.audit_counters.note(tenant.id, f"client_salt_{action}")
            self.metrics.client_salts.labels(tenant.id, action).inc()
            if action == "rejected":
                raise bad_request("cache_salt is set by the governor; do not send one",
                                  "cache_salt")
            body, _ = strip_client_salts(body)
        body = {k: v for k, v in body.items() if k != "priority"}
        body["model"] = caps.model_id
        stream = bool(body.get("stream"))
        wants_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        if stream:
            body["stream_options"] = {**(body.get("stream_options") or {}),
                                      "include_usage": True}
        priority = engine_priority(self.priorities, tenant.tenant_class, caps)
        salt = self.salt_for(tenant.id) if caps.cache_salt else None
        request = EngineRequest(request_id=request_id, route=route,  # type: ignore[arg-type]
                                body=body, tenant=tenant.id, cache_salt=salt,
                                priority=priority, stream=stream)
        return request, wants_usage

    async def admit(self, tenant: TenantConfig) -> float:
        if self.draining:
            raise EngineError(503, "the governor is shutting down", type="server_error")
        start = time.monotonic()
        await self.admission.acquire(tenant.id, tenant.max_concurrency,
                                     admission_rank(self.priorities, tenant.tenant_class))
        return time.monotonic() - start

    def release(self, tenant: TenantConfig) -> None:
        self.admission.release(tenant.id)

    async def record(self, event: AuditEvent) -> AuditRecord:
        """Append to the audit log (the writer thread commits it; this awaits durability);
        if that fails nothing may proceed (SEC-18)."""
        try:
            return await self.audit.append_async(event)
        except (AuditLogError, OSError) as exc:
            raise EngineError(503, f"the audit log cannot be written: {exc}",
                              type="server_error") from None

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

        task = asyncio.ensure_future(self.epochs.rotate(tenant_id, event_for,
                                                        self.audit.append_async))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        try:
            return await asyncio.shield(task)
        except (AuditLogError, OSError) as exc:
            raise EngineError(503, f"the audit log cannot be written: {exc}; the epoch is "
                              f"unchanged", type="server_error") from None

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
             "max_concurrency": t.max_concurrency, "max_tokens": t.max_tokens,
             "in_flight": self.admission.per_tenant.get(t.id, 0)}
            for t in self.config.tenants
        ]

    async def refresh_serving_metrics(self) -> None:
        self.metrics.set_serving(await self.driver.serving_metrics())
