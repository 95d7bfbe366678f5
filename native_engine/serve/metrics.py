"""`/metrics` of `fak engine serve`, with vLLM 0.32's names, types, labels and buckets.

A private prometheus_client registry (nothing global, two servers in one process do not
collide). Counters are declared without `_total`, as vLLM declares them; the exposition shows
`<name>_total` and `<name>_created`. The engine keeps cumulative counters itself
(LLMEngine.stats); each scrape feeds their growth since the previous scrape into the
Counters, so the exposition never runs ahead of or behind the engine. Latency histograms are
observed per request by a `RequestTimer` (TTFT, time between output events, end to end),
as vLLM's output processor does.

The KV tiers below the device pool (native_engine.kvcache.tiers) add `fak_kv_tier_*` families
labelled by `medium` ("CPU", "DISK"): resident blocks and bytes, capacity, hits, promotions,
demotions, restore failures, bytes written and read, and the start-up measurements (restore
bytes/s, whether restoring pays, prefill tokens/s).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from native_engine.engine import EngineStats
from native_engine.kvcache.tier_types import TierStats

LABELS = ("engine", "model_name")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort")
TIER_LABELS = (*LABELS, "medium")
# fak name -> (TierStats field, help text)
TIER_COUNTERS = {
    "fak_kv_tier_hits": ("hits", "KV blocks found (and verified) in a lower tier."),
    "fak_kv_tier_promotions": ("promotions", "KV blocks copied from a lower tier into the "
                               "device pool."),
    "fak_kv_tier_demotions": ("demotions", "KV blocks moved down into a lower tier."),
    "fak_kv_tier_restore_failures": ("restore_failures", "Lower-tier KV blocks that failed "
                                     "verification (deleted, served as a miss)."),
    "fak_kv_tier_written_bytes": ("bytes_written", "KV bytes written into a lower tier."),
    "fak_kv_tier_read_bytes": ("bytes_read", "KV bytes restored from a lower tier."),
}
TIER_GAUGES = {
    "fak_kv_tier_resident_blocks": ("resident_blocks", "KV blocks held by a lower tier."),
    "fak_kv_tier_resident_bytes": ("resident_bytes", "KV bytes held by a lower tier."),
    "fak_kv_tier_capacity_bytes": ("capacity_bytes", "Size of a lower KV tier."),
    "fak_kv_tier_restore_bytes_per_second": ("restore_bytes_per_s", "Restore rate measured "
                                             "at start-up."),
    "fak_kv_tier_restore_pays": ("restore_pays", "1 when restoring from the tier beats "
                                 "recomputing (start-up measurement), else 0."),
    "fak_kv_tier_prefill_tokens_per_second": ("prefill_tokens_per_s", "Prefill rate measured "
                                              "at start-up (the recompute side)."),
}
COMPUTE_INFO_HELP = ("Dtype, kernels and threads the native engine chose at start-up from "
                     "this machine's CPU flags.")
# vLLM name -> (EngineStats field, help text); all count tokens except preemptions.
STAT_COUNTERS = {
    "vllm:prefix_cache_queries": ("prefix_query_tokens",
                                  "Prefix cache queries, in terms of number of queried tokens."),
    "vllm:prefix_cache_hits": ("prefix_hit_tokens",
                               "Prefix cache hits, in terms of number of cached tokens."),
    "vllm:prompt_tokens_cached": ("prefix_hit_tokens", "Number of cached prompt tokens."),
    "vllm:num_preemptions": ("num_preemptions",
                             "Cumulative number of preemption from the engine."),
    "vllm:prompt_tokens": ("prompt_tokens", "Number of prefill tokens processed."),
    "vllm:generation_tokens": ("generation_tokens", "Number of generation tokens processed."),
}


@dataclass(frozen=True, slots=True)
class CacheInfo:
    """What `vllm:cache_config_info` carries (the adapter reads `block_size` from it)."""

    block_size: int
    num_gpu_blocks: int
    enable_prefix_caching: bool

    def labels(self) -> dict[str, str]:
        return {"block_size": str(self.block_size), "num_gpu_blocks": str(self.num_gpu_blocks),
                "enable_prefix_caching": str(self.enable_prefix_caching),
                "cache_dtype": "auto", "prefix_caching_hash_algo": "sha256_cbor"}


class RequestTimer:
    """One request's latencies; `on_output` per engine output, `on_finish` once."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics
        self._start = time.monotonic()
        self._last: float | None = None
        self._done = False

    def on_output(self, num_new_tokens: int) -> None:
        if num_new_tokens <= 0:
            return
        now = time.monotonic()
        if self._last is None:
            self._metrics.ttft.observe(now - self._start)
        else:
            self._metrics.itl.observe(now - self._last)
        self._last = now

    def on_finish(self, finish_reason: str) -> None:
        if self._done:
            return
        self._done = True
        self._metrics.e2e.observe(time.monotonic() - self._start)
        self._metrics.count_finished(finish_reason)


class ServerMetrics:
    """The registry and its families; `update(stats)` before each `render()`.

    Invariant (check_integrity): every stat counter equals the engine's cumulative value at
    the last update.
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str, cache: CacheInfo, engine_index: int = 0,
                 compute: dict[str, str] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.labels = {"engine": str(engine_index), "model_name": model_name}
        reg = self.registry
        self.running = self._gauge("vllm:num_requests_running",
                                   "Number of requests in model execution batches.")
        self.waiting = self._gauge("vllm:num_requests_waiting",
                                   "Number of requests waiting to be processed.")
        self.kv_usage = self._gauge("vllm:kv_cache_usage_perc",
                                    "KV-cache usage. 1 means 100 percent usage.")
        self._counters = {name: Counter(name, text, LABELS, registry=reg).labels(**self.labels)
                          for name, (_, text) in STAT_COUNTERS.items()}
        self._totals = dict.fromkeys(STAT_COUNTERS, 0)
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          (*LABELS, "finished_reason"), registry=reg)
        self._success = {reason: success.labels(**self.labels, finished_reason=reason)
                         for reason in FINISH_REASONS}
        self.ttft = self._histogram("vllm:time_to_first_token_seconds",
                                    "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = self._histogram("vllm:inter_token_latency_seconds",
                                   "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = self._histogram("vllm:e2e_request_latency_seconds",
                                   "Histogram of e2e request latency in seconds.", E2E_BUCKETS)
        self._tier_counters = {name: Counter(name, text, TIER_LABELS, registry=reg)
                               for name, (_, text) in TIER_COUNTERS.items()}
        self._tier_gauges = {name: Gauge(name, text, TIER_LABELS, registry=reg)
                             for name, (_, text) in TIER_GAUGES.items()}
        self._tier_totals: dict[tuple[str, str], int] = {}
        info = cache.labels()
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
              (*info, "engine"), registry=reg).labels(**info, engine=self.labels["engine"]).set(1)
        if compute is not None:  # fak's own: the dtype and kernels chosen for this machine
            Gauge("fak:engine_compute_info", COMPUTE_INFO_HELP, (*compute, "engine"),
                  registry=reg).labels(**compute, engine=self.labels["engine"]).set(1)

    def _gauge(self, name: str, text: str) -> Gauge:
        return Gauge(name, text, LABELS, registry=self.registry).labels(**self.labels)

    def _histogram(self, name: str, text: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, text, LABELS, buckets=buckets,
                         registry=self.registry).labels(**self.labels)

    def track(self) -> RequestTimer:
        return RequestTimer(self)

    def count_finished(self, finish_reason: str) -> None:
        self._success.get(finish_reason, self._success["abort"]).inc()

    def update(self, stats: EngineStats) -> None:
        """Bring gauges to `stats` and counters up to its cumulative values."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(min(1.0, max(0.0, stats.kv_usage)))
        for name, (field, _) in STAT_COUNTERS.items():
            value = getattr(stats, field)
            if value > self._totals[name]:
                self._counters[name].inc(value - self._totals[name])
                self._totals[name] = value
        for tier in stats.tiers:
            self._update_tier(tier)

    def _update_tier(self, tier: TierStats) -> None:
        labels = {**self.labels, "medium": tier.medium}
        for name, (field, _) in TIER_GAUGES.items():
            value = getattr(tier, field)
            self._tier_gauges[name].labels(**labels).set(float(value or 0))
        for name, (field, _) in TIER_COUNTERS.items():
            value, key = getattr(tier, field), (name, tier.medium)
            child = self._tier_counters[name].labels(**labels)  # exported from 0 on
            if value > self._tier_totals.get(key, 0):
                child.inc(value - self._tier_totals.get(key, 0))
                self._tier_totals[key] = value

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def check_integrity(self, stats: EngineStats) -> None:
        for name, (field, _) in STAT_COUNTERS.items():
            assert self._totals[name] == getattr(stats, field), f"{name} drifted"
        for tier in stats.tiers:
            for name, (field, _) in TIER_COUNTERS.items():
                assert self._tier_totals.get((name, tier.medium), 0) == getattr(tier, field), \
                    f"{name}{{medium={tier.medium}}} drifted"
