"""Quarantine planning: the full truth table of capabilities × require_exact."""

from __future__ import annotations

import hashlib
import itertools

import pytest

from policies.quarantine import PlanKind, QuarantineSpan, plan_quarantine
from schemas.engine import EngineCapabilities

SPAN = QuarantineSpan("tenant-a", 300, hashlib.sha256(b"poison").hexdigest())

# (exact_span_evict, prefix_reset, cache_salt, require_exact) -> (kind, degraded, reason)
TRUTH_TABLE = {
    (True, pf, salt, req): (PlanKind.EXACT, False, "exact_span_evict")
    for pf, salt, req in itertools.product((False, True), repeat=3)
}
TRUTH_TABLE.update(
    {
        (False, pf, salt, True): (PlanKind.REFUSE, False, "exact_required_but_unsupported")
        for pf, salt in itertools.product((False, True), repeat=2)
    }
)
TRUTH_TABLE.update(
    {
        (False, True, False, False): (
            PlanKind.WHOLE_PREFIX_FLUSH,
            True,
            "exact_span_unsupported_whole_prefix_flush",
        ),
        (False, True, True, False): (
            PlanKind.WHOLE_PREFIX_FLUSH,
            True,
            "exact_span_unsupported_whole_prefix_flush",
        ),
        (False, False, True, False): (
            PlanKind.SALT_ROTATION,
            True,
            "exact_span_unsupported_salt_rotation",
        ),
        (False, False, False, False): (PlanKind.REFUSE, False, "no_quarantine_capability"),
    }
)


def test_truth_table_is_complete() -> None:
    assert set(TRUTH_TABLE) == set(itertools.product((False, True), repeat=4))


@pytest.mark.parametrize("engine_kind", ["native", "vllm"])
@pytest.mark.parametrize(("row", "expected"), sorted(TRUTH_TABLE.items()))
def test_truth_table(engine_kind: str, row: tuple[bool, ...], expected: tuple) -> None:
    exact, prefix_reset, cache_salt, require_exact = row
    capabilities = EngineCapabilities(
        engine_kind=engine_kind,  # type: ignore[arg-type]
        model_id="m",
        exact_span_evict=exact,
        prefix_reset=prefix_reset,
        cache_salt=cache_salt,
        priority_scheduling=True,
        kv_events=True,
    )
    plan = plan_quarantine(SPAN, capabilities, require_exact)
    assert (plan.kind, plan.degraded, plan.reason) == expected
    assert plan.span is SPAN and plan.require_exact is require_exact
    assert plan.refused is (plan.kind is PlanKind.REFUSE)
    if require_exact:
        assert not plan.degraded and plan.kind in (PlanKind.EXACT, PlanKind.REFUSE)


@pytest.mark.parametrize(
    ("tenant", "tokens", "digest"),
    [
        ("", 1, None),
        ("t", 0, None),
        ("t", True, None),
        ("t", 1.5, None),
        ("t", 1, "ABC"),
        ("t", 1, "A" * 64),
    ],
)
def test_bad_span_is_refused(tenant: str, tokens: int, digest: str | None) -> None:
    with pytest.raises((TypeError, ValueError)):
        QuarantineSpan(tenant, tokens, digest)
