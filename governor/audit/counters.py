"""Per-tenant counters for client events, written as rate-bounded summary records.

A tenant decides how often it sends a `cache_salt` or a namespace header, so one record per
such request would let any tenant fill the audit log (and fsync on every request). Instead
the governor counts them (`note`, O(1), no I/O) and a timer writes one `client_input_summary`
record per tenant with counts pending, at most one per tenant per `interval_s`: 10,000
salt-bearing requests grow the log by summary records only. The first event after a quiet
interval is written at the next tick (the governor's audit loop ticks every second).

A summary's reasons are `<kind>=<count>` codes and `window_ms=<ms since the tenant's last
summary, or since counting began>`. Counts not yet written are held in memory: a crash loses
at most one interval of counts, never a record the log acknowledged; shutdown writes them
all (`pending_summaries(force=True)`).

Fail closed (SEC-18): `note` refuses (503) while the audit log cannot take appends, so a
salt-bearing request is never forwarded when its event could not be recorded.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from schemas.audit import AuditEvent, AuditState
from schemas.engine import EngineError

SUMMARY_KIND = "client_input_summary"
KINDS = ("client_salt_rejected", "client_salt_stripped", "client_header_dropped")
class AuditCounters:
    """Invariants (`check_integrity`): every pending count is positive and of a known kind;
    a tenant with pending counts has a window start."""

    def __init__(self, interval_s: float, audit_refusal: Callable[[], str | None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not interval_s > 0:
            raise ValueError("summary_interval_s must be > 0")
        self.interval_s = interval_s
        self._audit_refusal = audit_refusal
        self._clock = clock
        self._pending: dict[str, dict[str, int]] = {}
        self._window_start: dict[str, float] = {}
        self._last_written: dict[str, float] = {}
        self.noted = 0

    def note(self, tenant: str, kind: str) -> None:
        """Count one event of `kind` for `tenant`; 503 when the audit log is unwritable."""
        if kind not in KINDS:
            raise ValueError(f"unknown client event kind {kind!r}")
        problem = self._audit_refusal()
        if problem is not None:
            raise EngineError(503, f"the audit log cannot be written: {problem}",
                              type="server_error")
        counts = self._pending.setdefault(tenant, {})
        counts[kind] = counts.get(kind, 0) + 1
        self._window_start.setdefault(tenant, self._last_written.get(tenant, self._clock()))
        self.noted += 1

    def pending_summaries(self, force: bool = False) -> list[AuditEvent]:
        """Take the summaries due now (every pending one with `force`), as events to
        append; their counts leave the pending set. Put them back with `restore` if the
        append fails."""
        now = self._clock()
        events = []
        for tenant in sorted(self._pending):
            last = self._last_written.get(tenant)
            if not force and last is not None and now - last < self.interval_s:
                continue
            counts = self._pending.pop(tenant)
            window_ms = int((now - self._window_start.pop(tenant)) * 1000)
            reasons = tuple(f"{kind}={counts[kind]}" for kind in KINDS if kind in counts)
            events.append(AuditEvent(kind=SUMMARY_KIND, actor="governor",
                                     state=AuditState.RECORDED, tenant=tenant,
                                     reasons=(*reasons, f"window_ms={window_ms}")))
            self._last_written[tenant] = now
        return events

    def restore(self, events: list[AuditEvent]) -> None:
        """Count the summaries that could not be written again, so none is lost."""
        now = self._clock()
        for event in events:
            assert event.tenant is not None
            counts = self._pending.setdefault(event.tenant, {})
            window_s = 0.0
            for reason in event.reasons:
                name, _, value = reason.partition("=")
                if name in KINDS:
                    counts[name] = counts.get(name, 0) + int(value)
                elif name == "window_ms":
                    window_s = int(value) / 1000
            start = min(self._window_start.get(event.tenant, now), now - window_s)
            self._window_start[event.tenant] = start
            self._last_written.pop(event.tenant, None)

    def check_integrity(self) -> None:
        for tenant, counts in self._pending.items():
            assert counts and all(k in KINDS and n > 0 for k, n in counts.items()), counts
            assert tenant in self._window_start
