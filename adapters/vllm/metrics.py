"""vLLM `/metrics` → one normalised record (docs/design.md §5 "Metrics",
docs/reference/vllm-surfaces.md §3).

The exposition is parsed by prometheus_client's parser; this module only picks samples, and
hands the parser only the lines of the families it reads (`read_lines`): vLLM 0.32 exports
~60 families in ~630 lines, the pure-Python parser took 12 ms for all of them, and the
governor scrapes on a timer on the loop that relays generation. A fleet's health checks,
once a second per upstream, read only the load gauges (`loads_from_text`: 0.4 ms against
3.1 ms for a whole snapshot of a recorded 0.32 exposition). Every
vLLM name generation maps to the same field (`gpu_*` → `kv_*` / `prefix_*`,
`time_per_output_token` → `inter_token_latency`, counters with or without `_total`); the
newest name wins when an exposition carries both. Values are summed over DP engines (the
`engine` label) except `kv_usage`, which is their mean. A field the engine does not export is
None, never 0: the windowed prefix-cache hit ratio is None without both counters or without
queries in the window.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import TypeAlias

import httpx
from prometheus_client.parser import text_string_to_metric_families

from schemas.metrics import ServingMetrics

from .control_plane import CONTROL_ANSWER_BYTES, bounded_request
from .urls import EngineURLs

Buckets: TypeAlias = tuple[tuple[float, float], ...]
"""Cumulative histogram buckets: (upper bound, count), ascending, ending at +Inf."""

GAUGES: dict[str, tuple[str, ...]] = {
    "running": ("vllm:num_requests_running",),
    "waiting": ("vllm:num_requests_waiting",),
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
}
COUNTERS: dict[str, tuple[str, ...]] = {
    "prefix_cache_queries": ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"),
    "prefix_cache_hits": ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"),
    "preemptions": ("vllm:num_preemptions",),
    "prompt_tokens": ("vllm:prompt_tokens",),
    "generation_tokens": ("vllm:generation_tokens",),
    "cached_tokens": ("vllm:prompt_tokens_cached",),
}
HISTOGRAMS: dict[str, tuple[str, ...]] = {
    "ttft": ("vllm:time_to_first_token_seconds",),
    "itl": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
}
QUANTILES: tuple[tuple[str, float], ...] = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))
CACHE_CONFIG = "vllm:cache_config_info"
READ_FAMILIES: tuple[str, ...] = tuple(sorted({
    *(name for names in (*GAUGES.values(), *COUNTERS.values(), *HISTOGRAMS.values())
      for name in names), CACHE_CONFIG}))
LOAD_FAMILIES: tuple[str, ...] = (*GAUGES["running"], *GAUGES["waiting"])


class MetricsParseError(ValueError):
    """The text is not a Prometheus exposition the parser accepts."""


class MetricsScrapeError(RuntimeError):
    """`/metrics` could not be fetched."""


Samples: TypeAlias = dict[str, list[tuple[dict[str, str], float]]]


def read_lines(text: str, families: tuple[str, ...] = READ_FAMILIES) -> str:
    """The lines of `text` that belong to `families` (samples, HELP and TYPE), in order.
    Kept by name prefix, so a family whose name extends a read one's stays (parsed, then
    not picked); a sample line that opens with a quoted name (`{"name", ...}`) stays too.
    The parser reads each family from its TYPE line and samples alone, so the families kept
    parse as they do in the whole text."""
    kept, sample_starts = [], (*families, "{")
    for line in text.split("\n"):
        stripped = line.strip()
        if stripped.startswith("#"):
            parts = stripped.split(None, 3)
            if len(parts) < 3 or parts[1] not in ("HELP", "TYPE") or \
                    not parts[2].lstrip('"').startswith(families):
                continue
        elif not stripped.startswith(sample_starts):
            continue
        kept.append(line)
    return "\n".join(kept) + "\n" if kept else ""


def parse_samples(text: str) -> Samples:
    """Every sample by its exposition name; any parser failure is one MetricsParseError."""
    samples: Samples = defaultdict(list)
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[sample.name].append((dict(sample.labels), float(sample.value)))
    except Exception as exc:  # the third-party parser raises several types on garbage
        raise MetricsParseError(f"unparseable metrics exposition: {exc}") from exc
    return dict(samples)


@dataclass(frozen=True, slots=True)
class CacheConfigInfo:
    """One engine's `vllm:cache_config_info` labels that fak relies on (None = absent)."""

    engine: str | None
    prefix_caching_hash_algo: str | None
    enable_prefix_caching: bool | None
    block_size: int | None
    num_gpu_blocks: int | None
    num_cpu_blocks: int | None

    @property
    def num_blocks(self) -> int | None:
        """Blocks the engine can hold on every medium it reports (GPU, plus CPU offload)."""
        if self.num_gpu_blocks is None:
            return None
        return self.num_gpu_blocks + (self.num_cpu_blocks or 0)


@dataclass(frozen=True, slots=True)
class MetricsSnapshot:
    """Cumulative values of one scrape, by normalised field name (None = not exported)."""

    gauges: dict[str, float | None]
    counters: dict[str, float | None]
    histograms: dict[str, Buckets | None]
    block_size: int | None = None
    cache_config: tuple[CacheConfigInfo, ...] = ()
    engine_load: dict[str, float] | None = None
    """Running + waiting requests per DP engine (`engine` label); None if not exported."""


def _matching(rows: list[tuple[dict[str, str], float]], model: str | None) -> list[float]:
    return [value for labels, value in rows if model is None or labels.get("model_name") == model]


def _first_present(
    samples: Samples, names: tuple[str, ...], model: str | None
) -> list[float] | None:
    for name in names:
        values = _matching(samples.get(name, []), model)
        if values:
            return values
    return None


def _gauge(samples: Samples, field: str, model: str | None) -> float | None:
    values = _first_present(samples, GAUGES[field], model)
    if values is None:
        return None
    return sum(values) / len(values) if field == "kv_usage" else sum(values)


def _counter(samples: Samples, field: str, model: str | None) -> float | None:
    names = tuple(n + suffix for n in COUNTERS[field] for suffix in ("_total", ""))
    values = _first_present(samples, names, model)
    return None if values is None else sum(values)


def _histogram(samples: Samples, field: str, model: str | None) -> Buckets | None:
    for name in HISTOGRAMS[field]:
        per_bound: dict[float, float] = defaultdict(float)
        for labels, value in samples.get(name + "_bucket", []):
            if (model is None or labels.get("model_name") == model) and "le" in labels:
                per_bound[float(labels["le"])] += value
        if per_bound and math.inf in per_bound:
            return tuple(sorted(per_bound.items()))
    return None


def _engine_load(samples: Samples, model: str | None) -> dict[str, float] | None:
    load: dict[str, float] = defaultdict(float)
    for name in (*GAUGES["running"], *GAUGES["waiting"]):
        for labels, value in samples.get(name, []):
            if model is None or labels.get("model_name") == model:
                load[labels.get("engine", "0")] += value
    return dict(load) if load else None


def _label_int(labels: dict[str, str], name: str) -> int | None:
    raw = labels.get(name, "")
    return int(raw) if raw.isdigit() else None


def _cache_config(samples: Samples) -> tuple[CacheConfigInfo, ...]:
    """One record per engine (DP rank) exporting `vllm:cache_config_info`."""
    records = []
    for labels, _ in samples.get(CACHE_CONFIG, []):
        prefix = labels.get("enable_prefix_caching")
        records.append(CacheConfigInfo(
            engine=labels.get("engine"),
            prefix_caching_hash_algo=labels.get("prefix_caching_hash_algo") or None,
            enable_prefix_caching=None if prefix not in ("True", "False") else prefix == "True",
            block_size=_label_int(labels, "block_size"),
            num_gpu_blocks=_label_int(labels, "num_gpu_blocks"),
            num_cpu_blocks=_label_int(labels, "num_cpu_blocks"),
        ))
    return tuple(records)


def _check_value(name: str, value: float | None, upper: float = math.inf) -> None:
    if value is not None and not 0 <= value <= upper:
        raise MetricsParseError(f"{name} out of range: {value}")


def _check_buckets(name: str, buckets: Buckets | None) -> None:
    if buckets is None:
        return
    bounds, counts = [b for b, _ in buckets], [c for _, c in buckets]
    finite = all(0 <= b < math.inf for b in bounds[:-1]) and all(0 <= c < math.inf for c in counts)
    if not finite:
        raise MetricsParseError(f"histogram {name} has bounds or counts out of range")
    if counts != sorted(counts):
        raise MetricsParseError(f"histogram {name} is not cumulative")


def snapshot_from_text(text: str, model: str | None = None) -> MetricsSnapshot:
    """Parse one exposition; `model` keeps only samples with that `model_name` label.

    Picked values must be finite and ≥ 0 (kv_usage ≤ 1) and histograms cumulative;
    anything else is a MetricsParseError rather than a wrong number.
    """
    samples = parse_samples(read_lines(text))
    try:
        histograms = {f: _histogram(samples, f, model) for f in HISTOGRAMS}
    except ValueError as exc:
        raise MetricsParseError(f"histogram with a non-numeric bucket bound: {exc}") from exc
    cache_config = _cache_config(samples)
    snapshot = MetricsSnapshot(
        gauges={f: _gauge(samples, f, model) for f in GAUGES},
        counters={f: _counter(samples, f, model) for f in COUNTERS},
        histograms=histograms,
        block_size=next((c.block_size for c in cache_config if c.block_size), None),
        cache_config=cache_config,
        engine_load=_engine_load(samples, model),
    )
    for name, value in (*snapshot.gauges.items(), *snapshot.counters.items()):
        _check_value(name, value, 1.0 if name == "kv_usage" else math.inf)
    for name, buckets in histograms.items():
        _check_buckets(name, buckets)
    return snapshot


def loads_from_text(text: str, model: str | None = None) -> dict[str, float] | None:
    """Running plus waiting requests per DP engine, from the load gauges' lines alone (None
    if not exported). Garbage in those lines, or a sample that is not finite and ≥ 0, is a
    MetricsParseError; garbage elsewhere is not read."""
    samples = parse_samples(read_lines(text, LOAD_FAMILIES))
    for name in LOAD_FAMILIES:
        for _, value in samples.get(name, ()):
            _check_value(name, value)
    return _engine_load(samples, model)


def histogram_quantile(q: float, buckets: Buckets | None) -> float | None:
    """Prometheus' histogram_quantile: linear inside the bucket; None without observations."""
    if buckets is None or not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for upper_bound, count in buckets:
        if count >= rank:
            if math.isinf(upper_bound):
                return lower_bound
            if count == lower_count:
                return upper_bound
            return lower_bound + (upper_bound - lower_bound) * (rank - lower_count) / (
                count - lower_count
            )
        lower_bound, lower_count = upper_bound, count
    return lower_bound


def _counter_delta(before: float | None, after: float | None) -> float | None:
    if after is None:
        return None
    if before is None or after < before:  # no baseline, or the engine restarted
        return after
    return after - before


def _buckets_delta(before: Buckets | None, after: Buckets | None) -> Buckets | None:
    if after is None or before is None:
        return after
    old = dict(before)
    deltas = tuple((bound, count - old.get(bound, 0.0)) for bound, count in after)
    if any(count < 0 for _, count in deltas) or set(old) != {b for b, _ in after}:
        return after  # reset or changed bucket layout: the window starts at the reset
    return deltas


def serving_metrics(
    after: MetricsSnapshot, before: MetricsSnapshot | None = None
) -> ServingMetrics:
    """The window (before, after]; without `before`, everything since engine start."""
    counters = {
        f: _counter_delta(before.counters[f] if before else None, after.counters[f])
        for f in COUNTERS
    }
    queries, hits = counters["prefix_cache_queries"], counters["prefix_cache_hits"]
    # No queries, no hits counter, or inconsistent counters: no ratio rather than a wrong one.
    ratio = hits / queries if queries and hits is not None and hits <= queries else None
    quantiles = {}
    for field in HISTOGRAMS:
        window = _buckets_delta(
            before.histograms[field] if before else None, after.histograms[field]
        )
        for label, q in QUANTILES:
            quantiles[f"{field}_{label}"] = histogram_quantile(q, window)
    return ServingMetrics(
        running=after.gauges["running"],
        waiting=after.gauges["waiting"],
        kv_usage=after.gauges["kv_usage"],
        prefix_cache_hit_ratio=ratio,
        **counters,
        **quantiles,
    )


async def scrape(
    client: httpx.AsyncClient, urls: EngineURLs, model: str | None = None,
    limit: int = CONTROL_ANSWER_BYTES,
) -> MetricsSnapshot:
    """GET /metrics (at most `limit` bytes) and parse it."""
    return snapshot_from_text(await exposition(client, urls, limit), model)


async def scrape_loads(
    client: httpx.AsyncClient, urls: EngineURLs, model: str | None = None,
    limit: int = CONTROL_ANSWER_BYTES,
) -> dict[str, float] | None:
    """GET /metrics (at most `limit` bytes) and read the engines' loads only."""
    return loads_from_text(await exposition(client, urls, limit), model)


async def exposition(client: httpx.AsyncClient, urls: EngineURLs,
                     limit: int = CONTROL_ANSWER_BYTES) -> str:
    """The text of GET /metrics (at most `limit` bytes); MetricsScrapeError otherwise."""
    endpoint = urls.metrics()
    try:
        response = await bounded_request(client, endpoint.method, endpoint.url, limit)
    except httpx.HTTPError as exc:
        # The path and class only: the rest can carry the upstream's address.
        raise MetricsScrapeError(
            f"GET {endpoint.url.path} failed: {type(exc).__name__}") from exc
    if response.status_code != 200:
        raise MetricsScrapeError(f"GET {endpoint.url.path} answered {response.status_code}")
    return response.text
