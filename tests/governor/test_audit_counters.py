"""Client-event counters: rate-bounded per-tenant summaries, nothing lost, fail closed."""

from __future__ import annotations

import itertools

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from governor.audit.counters import KINDS, SUMMARY_KIND, AuditCounters
from schemas.audit import AuditEvent
from schemas.engine import EngineError


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def counts(event: AuditEvent) -> dict[str, int]:
    return {k: int(v) for k, _, v in (r.partition("=") for r in event.reasons)}


def test_first_event_is_due_at_once_then_one_summary_per_interval() -> None:
    clock = Clock()
    c = AuditCounters(10.0, lambda: None, clock)
    c.note("acme", "client_salt_rejected")
    (first,) = c.pending_summaries()
    assert (first.kind, first.tenant, first.actor) == (SUMMARY_KIND, "acme", "governor")
    assert counts(first) == {"client_salt_rejected": 1, "window_ms": 0}
    for _ in range(5000):
        c.note("acme", "client_salt_rejected")
    c.note("acme", "client_header_dropped")
    clock.now += 9.9
    assert c.pending_summaries() == []  # within the interval: counted, not written
    clock.now += 0.1
    (second,) = c.pending_summaries()
    assert counts(second) == {"client_salt_rejected": 5000, "client_header_dropped": 1,
                              "window_ms": 10_000}
    assert c.pending_summaries() == []
    c.check_integrity()


def test_force_writes_everything_and_restore_loses_nothing() -> None:
    clock = Clock()
    c = AuditCounters(60.0, lambda: None, clock)
    c.note("acme", "client_salt_stripped")
    c.pending_summaries()
    c.note("acme", "client_salt_stripped")
    c.note("beta", "client_header_dropped")
    assert [e.tenant for e in c.pending_summaries()] == ["beta"]  # acme waits its interval
    clock.now += 1
    events = c.pending_summaries(force=True)
    assert [e.tenant for e in events] == ["acme"]
    c.restore(events)  # the append failed: counted again, due at the next try
    c.note("acme", "client_salt_stripped")
    (again,) = c.pending_summaries()
    assert counts(again)["client_salt_stripped"] == 2
    c.check_integrity()


def test_note_fails_closed_and_refuses_unknown_kinds() -> None:
    refusal: list[str] = []
    c = AuditCounters(1.0, lambda: refusal[0] if refusal else None)
    with pytest.raises(ValueError, match="unknown"):
        c.note("acme", "client_salt_smuggled")
    refusal.append("the audit log refuses appends after a failed write: ENOSPC")
    with pytest.raises(EngineError) as err:
        c.note("acme", "client_salt_rejected")
    assert err.value.status == 503 and "ENOSPC" in str(err.value)
    assert c.pending_summaries(force=True) == []
    with pytest.raises(ValueError):
        AuditCounters(0, lambda: None)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.sampled_from(KINDS),
                          st.floats(0, 3)), max_size=200))
def test_summaries_are_rate_bounded_and_add_up(noted: list[tuple[str, str, float]]) -> None:
    clock = Clock()
    c = AuditCounters(2.0, lambda: None, clock)
    written: list[tuple[float, AuditEvent]] = []
    for tenant, kind, pause in noted:
        clock.now += pause
        c.note(tenant, kind)
        written += [(clock.now, e) for e in c.pending_summaries()]
    written += [(clock.now + 1, e) for e in c.pending_summaries(force=True)]
    c.check_integrity()
    for tenant in "abc":
        times = [t for t, e in written if e.tenant == tenant][:-1]  # the last is forced
        assert all(b - a >= 2.0 for a, b in itertools.pairwise(times))
        for kind in KINDS:
            total = sum(counts(e).get(kind, 0) for _, e in written if e.tenant == tenant)
            assert total == sum(1 for t, k, _ in noted if (t, k) == (tenant, kind))
