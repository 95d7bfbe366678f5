"""Value-aware eviction (docs/design.md §3), used by the native engine's radix cache.

    value(c) = recompute_cost(c.tokens) × reuse_probability(c.hits, total_accesses) / c.bytes

`recompute_cost` is linear in tokens (prefill work to rebuild the span's KV);
`reuse_probability` is Laplace's rule of succession, (hits + 1) / (total_accesses + 2).
The cheapest value is evicted first; ties go to the oldest `last_use`, then to input order.
Pinned and in-use candidates are never victims. With equal tokens, bytes and hits every
value is equal, so the order is exactly LRU. Sorting makes a choice O(n log n).

The caller passes the candidates it may evict now (for a radix tree: its leaves); when a
victim's parent becomes a leaf the caller asks again.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EvictionCandidate:
    """A cached span: `tokens` it holds, `bytes` of KV it occupies, `hits` (reuses so far),
    `last_use` (caller's clock), and whether it is `pinned` or `in_use` (lock ref > 0)."""

    key: Hashable
    tokens: int
    bytes: int
    hits: int
    last_use: float
    pinned: bool = False
    in_use: bool = False

    def __post_init__(self) -> None:
        for name in ("tokens", "bytes", "hits"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int")
        if self.tokens < 0 or self.hits < 0:
            raise ValueError(f"tokens and hits must be >= 0 (key {self.key!r})")
        if self.bytes <= 0:
            raise ValueError(f"bytes must be > 0 (key {self.key!r})")

    @property
    def evictable(self) -> bool:
        return not (self.pinned or self.in_use)


@dataclass(frozen=True, slots=True)
class EvictionChoice:
    """Victims in eviction order; `satisfied` is False when even all evictable bytes fall short."""

    victims: tuple[Hashable, ...]
    bytes_freed: int
    satisfied: bool


def recompute_cost(tokens: int) -> float:
    return float(tokens)


def reuse_probability(hits: int, total_accesses: int) -> float:
    """Laplace: (hits + 1) / (total_accesses + 2)."""
    if hits < 0 or total_accesses < hits:
        raise ValueError(f"need 0 <= hits <= total_accesses, got {hits}, {total_accesses}")
    return (hits + 1) / (total_accesses + 2)


def eviction_value(candidate: EvictionCandidate, total_accesses: int) -> float:
    """What keeping the candidate is worth per byte; lower is evicted first."""
    probability = reuse_probability(candidate.hits, total_accesses)
    return recompute_cost(candidate.tokens) * probability / candidate.bytes


def choose_victims(
    candidates: Sequence[EvictionCandidate],
    bytes_needed: int,
    total_accesses: int | None = None,
) -> EvictionChoice:
    """The cheapest evictable candidates, in order, until `bytes_needed` are freed.

    `total_accesses` defaults to the largest `hits` among the candidates (any value ≥ every
    `hits` gives the same order, since it scales every probability alike).
    """
    if bytes_needed <= 0:
        return EvictionChoice((), 0, True)
    if total_accesses is None:
        total_accesses = max((c.hits for c in candidates), default=0)
    ranked = sorted(
        (c for c in candidates if c.evictable),
        key=lambda c: (eviction_value(c, total_accesses), c.last_use),
    )
    victims: list[Hashable] = []
    freed = 0
    for candidate in ranked:
        if freed >= bytes_needed:
            break
        victims.append(candidate.key)
        freed += candidate.bytes
    return EvictionChoice(tuple(victims), freed, freed >= bytes_needed)
