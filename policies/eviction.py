"""Value-aware eviction (docs/design.md §3), used by the native engine's radix cache and its
lower KV tiers (host RAM, disk).

    value(c) = saving(c) × reuse_probability(c.hits, total_accesses) / c.bytes
    saving(c) = max(recompute_cost(c.tokens) - c.restore_cost, 0)

`recompute_cost` is linear in tokens (prefill work to rebuild the span's KV); `restore_cost`
is what bringing the span back from the candidate's tier costs, in the same unit (prefill
tokens; 0 for the device pool, which attention reads directly); `reuse_probability` is
Laplace's rule of succession, (hits + 1) / (total_accesses + 2).
The cheapest value is evicted first; ties go to the oldest `last_use`, then to input order.
Pinned and in-use candidates are never victims. With equal tokens, bytes and hits every
value is equal, so the order is exactly LRU. Sorting makes a choice O(n log n).

The caller passes the candidates it may evict now (for a radix tree: its leaves); when a
victim's parent becomes a leaf the caller asks again.

Restore or recompute (`RestoreRates`, `restore_cost_tokens`, `restore_pays`): a tier's copy is
worth restoring only when moving its bytes at the tier's measured rate takes less time than
prefilling its tokens at the measured prefill rate. The rates are inputs, measured by the
engine at start-up on the machine it runs on; nothing here reads a clock.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field


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
    restore_cost: float = 0.0

    def __post_init__(self) -> None:
        if not math.isfinite(self.restore_cost) or self.restore_cost < 0:
            raise ValueError(f"restore_cost must be finite and >= 0 (key {self.key!r})")
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
    saving = max(recompute_cost(candidate.tokens) - candidate.restore_cost, 0.0)
    return saving * probability / candidate.bytes


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


# --- restore or recompute ---------------------------------------------------------------


def _positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class RestoreRates:
    """Measured throughputs: `prefill_tokens_per_s` of the model on this machine, and per
    tier medium ("CPU", "DISK") the bytes per second a restore into the device pool moves,
    verification included. A medium without a rate is never restored from."""

    prefill_tokens_per_s: float
    restore_bytes_per_s: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _positive("prefill_tokens_per_s", self.prefill_tokens_per_s)
        for medium, rate in self.restore_bytes_per_s.items():
            _positive(f"restore_bytes_per_s[{medium!r}]", rate)


def restore_cost_tokens(nbytes: int, medium: str, rates: RestoreRates) -> float:
    """Restoring `nbytes` from `medium`, in prefill tokens (the unit of recompute_cost);
    infinite for a medium without a measured rate."""
    rate = rates.restore_bytes_per_s.get(medium)
    if rate is None:
        return math.inf
    return nbytes / rate * rates.prefill_tokens_per_s


def restore_pays(tokens: int, nbytes: int, medium: str, rates: RestoreRates) -> bool:
    """True when restoring a span of `tokens` tokens and `nbytes` KV bytes from `medium` is
    cheaper than recomputing it."""
    return restore_cost_tokens(nbytes, medium, rates) < recompute_cost(tokens)
