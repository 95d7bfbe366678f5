"""Token buckets for per-tenant rate limits (requests per second, tokens per minute).

A bucket holds `level` tokens at time `at` and refills `rate` tokens per second up to
`capacity`. Time is an argument (seconds on any monotonic clock), so the arithmetic is
pure and testable. A request takes one token from its requests bucket or is refused with
the wait until one is there; generated work is debited from the tokens bucket after the
fact (the count is known only then), which may leave it in debt: while the level is not
positive, new requests are refused with the time the debt takes to refill.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class Bucket:
    rate: float
    capacity: float
    level: float
    at: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rate) and self.rate > 0):
            raise ValueError("rate must be a positive number")
        if not (math.isfinite(self.capacity) and self.capacity > 0):
            raise ValueError("capacity must be a positive number")

    @classmethod
    def full(cls, rate: float, capacity: float, now: float) -> Bucket:
        return cls(rate, capacity, capacity, now)

    def refilled(self, now: float) -> Bucket:
        elapsed = max(0.0, now - self.at)
        return replace(self, level=min(self.capacity, self.level + elapsed * self.rate),
                       at=max(now, self.at))

    def take(self, now: float, amount: float = 1.0) -> tuple[Bucket, float]:
        """Take `amount` if there: (new bucket, 0). Else (refilled bucket, seconds until
        it would be there); nothing is taken."""
        bucket = self.refilled(now)
        if bucket.level >= amount:
            return replace(bucket, level=bucket.level - amount), 0.0
        return bucket, (amount - bucket.level) / bucket.rate

    def debit(self, now: float, amount: float) -> Bucket:
        """Charge work already done; the level may go negative (debt)."""
        bucket = self.refilled(now)
        return replace(bucket, level=bucket.level - amount)

    def wait_until_positive(self, now: float) -> float:
        """Seconds until the level is above zero (0 if it is)."""
        bucket = self.refilled(now)
        return 0.0 if bucket.level > 0 else (-bucket.level + 1e-9) / bucket.rate


def requests_bucket(requests_per_s: float, now: float) -> Bucket:
    """One second of requests may come in a burst (at least one)."""
    return Bucket.full(requests_per_s, max(1.0, requests_per_s), now)


def tokens_bucket(tokens_per_min: int, now: float) -> Bucket:
    return Bucket.full(tokens_per_min / 60.0, float(tokens_per_min), now)
