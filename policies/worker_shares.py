"""Admission caps split across `fak serve --workers N` processes, so that they still hold.

Each worker admits on its own (no shared counter on the request path), so every cap is
divided: worker `index` of `workers` gets `total // workers`, plus one for the first
`total % workers` workers. The shares sum to exactly the total, so N workers together never
admit more than one process would: concurrency, queue places, tokens per minute. A
requests-per-second limit is split evenly; its bucket's burst is one second of its rate
(policies.rate_limits), so the bursts sum to the total too — as long as each share is at
least one request per second (below that a bucket's burst is rounded up to one request).
A cap that cannot give every worker at least one (a share of 0 would refuse all of that
tenant's requests on that worker) is refused: `unsplittable` says which.
"""

from __future__ import annotations

from dataclasses import replace

from schemas.tenants import TenantConfig


def integer_share(total: int, workers: int, index: int) -> int:
    """Worker `index`'s part of `total`; the parts of all workers sum to `total`."""
    if not 0 <= index < workers:
        raise ValueError(f"worker index {index} is not in [0, {workers})")
    return total // workers + (1 if index < total % workers else 0)


def unsplittable(tenant: TenantConfig, workers: int) -> str | None:
    """Why `tenant`'s caps cannot be shared by `workers` processes (None: they can)."""
    for name in ("max_concurrency", "max_queued", "tokens_per_min"):
        value = getattr(tenant, name)
        if value is not None and value < workers:
            return f"tenant {tenant.id}: {name} = {value} cannot give each of {workers} " \
                   "workers at least 1"
    if tenant.requests_per_s is not None and tenant.requests_per_s < workers:
        return f"tenant {tenant.id}: requests_per_s = {tenant.requests_per_s:g} cannot give " \
               f"each of {workers} workers at least 1 request per second"
    return None


def tenant_share(tenant: TenantConfig, workers: int, index: int) -> TenantConfig:
    """The tenant as worker `index` admits it (`unsplittable` must have said None)."""

    def part(value: int | None) -> int | None:
        return None if value is None else integer_share(value, workers, index)

    rate = None if tenant.requests_per_s is None else tenant.requests_per_s / workers
    max_concurrency = integer_share(tenant.max_concurrency, workers, index)
    return replace(tenant, max_concurrency=max_concurrency, max_queued=part(tenant.max_queued),
                   tokens_per_min=part(tenant.tokens_per_min), requests_per_s=rate)
