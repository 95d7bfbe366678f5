"""Normalised serving metrics: one `fak_serving_*` record whatever the engine (docs/design.md §5).

Every field is None when the engine does not export it — never a false 0. Counters are the
deltas over the scrape window (or totals since engine start when there is no earlier
scrape); `prefix_cache_hit_ratio` is windowed hits / queries; latency quantiles are seconds,
estimated from the engine's histograms over the same window. `itl_*` is vLLM's
inter-token latency: per output chunk, not per token (docs/reference/vllm-surfaces.md §3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

METRIC_PREFIX = "fak_serving_"
FRACTIONS = ("kv_usage", "prefix_cache_hit_ratio")


@dataclass(frozen=True, slots=True)
class ServingMetrics:
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None
    prefix_cache_hit_ratio: float | None = None
    preemptions: float | None = None
    prompt_tokens: float | None = None
    generation_tokens: float | None = None
    cached_tokens: float | None = None
    ttft_p50: float | None = None
    ttft_p90: float | None = None
    ttft_p99: float | None = None
    itl_p50: float | None = None
    itl_p90: float | None = None
    itl_p99: float | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"{f.name} must be a number or None, got {value!r}")
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{f.name} must be finite and ≥ 0, got {value}")
            if f.name in FRACTIONS and value > 1:
                raise ValueError(f"{f.name} is a fraction 0..1, got {value}")

    def as_gauges(self) -> dict[str, float]:
        """`fak_serving_<field>` → value, for the fields the engine exported."""
        return {
            METRIC_PREFIX + f.name: float(getattr(self, f.name))
            for f in fields(self)
            if getattr(self, f.name) is not None
        }
