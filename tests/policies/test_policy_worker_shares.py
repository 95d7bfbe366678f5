"""policies.worker_shares: the workers' shares sum to every configured cap, each at least 1."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from policies.worker_shares import integer_share, tenant_share, unsplittable
from schemas.tenants import TenantConfig

DIGEST = "0" * 64


def tenant(**limits: object) -> TenantConfig:
    return TenantConfig(id="acme", api_key_sha256=(DIGEST,), **limits)  # type: ignore[arg-type]


@given(st.integers(1, 10_000), st.integers(1, 64))
def test_integer_shares_sum_to_the_total_and_differ_by_at_most_one(total: int,
                                                                    workers: int) -> None:
    shares = [integer_share(total, workers, i) for i in range(workers)]
    assert sum(shares) == total
    assert max(shares) - min(shares) <= 1


@given(st.integers(2, 8), st.integers(8, 500), st.integers(8, 500), st.floats(8.0, 1e4),
       st.integers(8, 10**6))
def test_tenant_shares_sum_to_its_caps(workers: int, concurrency: int, queued: int,
                                       rate: float, tokens: int) -> None:
    whole = tenant(max_concurrency=concurrency, max_queued=queued, requests_per_s=rate,
                   tokens_per_min=tokens)
    assert unsplittable(whole, workers) is None
    parts = [tenant_share(whole, workers, i) for i in range(workers)]
    assert sum(p.max_concurrency for p in parts) == concurrency
    assert sum(p.queue_limit for p in parts) == queued
    assert sum(p.tokens_per_min or 0 for p in parts) == tokens
    assert abs(sum(p.requests_per_s or 0.0 for p in parts) - rate) < 1e-9 * rate
    # each bucket's burst is one second of its rate (≥ 1): the bursts sum to the total too
    assert all((p.requests_per_s or 0.0) >= 1.0 for p in parts)


def test_an_unset_queue_follows_the_concurrency_share() -> None:
    parts = [tenant_share(tenant(max_concurrency=5), 2, i) for i in range(2)]
    assert [p.max_queued for p in parts] == [None, None]
    assert sum(p.queue_limit for p in parts) == 5


def test_caps_below_one_per_worker_are_refused_by_name() -> None:
    assert "max_concurrency = 1" in (unsplittable(tenant(max_concurrency=1), 2) or "")
    assert "max_queued = 2" in (unsplittable(tenant(max_queued=2), 3) or "")
    assert "tokens_per_min = 3" in (unsplittable(tenant(tokens_per_min=3), 4) or "")
    assert "requests_per_s = 1.5" in (unsplittable(tenant(requests_per_s=1.5), 2) or "")
    assert unsplittable(tenant(max_concurrency=2, requests_per_s=2.0), 2) is None
