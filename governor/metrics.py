"""The governor's own Prometheus metrics, per tenant, on a private registry."""

from __future__ import annotations

import bisect
import itertools
import math
import time
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from adapters.driver import Fleet

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class ServingCollector(Collector):
    """Exposes the engine's last normalised snapshot as `fak_serving_<field>` gauges."""

    def __init__(self) -> None:
        self.snapshot: dict[str, float] = {}

    def collect(self):  # type: ignore[override]
        for name, value in sorted(self.snapshot.items()):
            family = GaugeMetricFamily(f"fak_serving_{name}", f"Engine {name} (normalised).")
            family.add_metric([], value)
            yield family


class LatencyHistogram:
    """One histogram series as plain numbers: a count per `LATENCY_BUCKETS` bucket (and one
    past the last), their sum and when the series began."""

    __slots__ = ("counts", "created", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1  # le: value ≤ bound
        self.sum += seconds

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative (le, count) pairs, `+Inf` last, as the exposition writes them."""
        running = list(itertools.accumulate(self.counts))
        return [(floatToGoString(b), n) for b, n in zip((*LATENCY_BUCKETS, math.inf), running,
                                                        strict=True)]


class TenantMeters:
    """One tenant's per-request series as plain numbers, updated on the event loop (their
    only writer) and read at scrape time by `ServedCollector`: a prometheus_client child
    takes a lock per update, ~40 Python calls for one request's seven updates."""

    def __init__(self, metrics: GovernorMetrics, tenant: str, tenant_class: str) -> None:
        self.tenant = tenant
        self.created = time.time()
        self.served: dict[tuple[str, str], list[float]] = {}  # (route, outcome) → [n, created]
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.ttft = LatencyHistogram()
        self.e2e = LatencyHistogram()
        self.admission_wait = metrics.admission_wait_of(tenant_class)

    def count_request(self, route: str, outcome: str) -> None:
        counted = self.served.get((route, outcome))
        if counted is None:
            self.served[(route, outcome)] = [1, time.time()]
        else:
            counted[0] += 1


class ServedCollector(Collector):
    """The per-request series of every tenant that has been served, at scrape time:
    `fak_requests` by tenant, route and outcome, token counters and latency histograms by
    tenant, the admission wait by tenant class."""

    def __init__(self) -> None:
        self.tenants: dict[str, TenantMeters] = {}
        self.admission_waits: dict[str, LatencyHistogram] = {}

    def collect(self) -> Iterator[Metric]:  # type: ignore[override]
        requests = CounterMetricFamily("fak_requests", "Requests by tenant, route and outcome.",
                                       labels=["tenant", "route", "outcome"])
        tokens = [(CounterMetricFamily(name, text, labels=["tenant"]), attr)
                  for name, text, attr in TOKEN_COUNTERS]
        latencies = [(HistogramMetricFamily(name, text, labels=["tenant"]), attr)
                     for name, text, attr in LATENCY_HISTOGRAMS]
        for tenant, meters in list(self.tenants.items()):
            for (route, outcome), (n, created) in list(meters.served.items()):
                requests.add_metric([tenant, route, outcome], n, created=created)
            for counter, attr in tokens:
                counter.add_metric([tenant], getattr(meters, attr), created=meters.created)
            for family, attr in latencies:
                _add_histogram(family, {"tenant": tenant}, getattr(meters, attr))
        wait = HistogramMetricFamily("fak_admission_wait_seconds", "Time queued for a slot.",
                                     labels=["tenant_class"])
        for tenant_class, histogram in list(self.admission_waits.items()):
            _add_histogram(wait, {"tenant_class": tenant_class}, histogram)
        yield from (requests, *(c for c, _ in tokens), *(h for h, _ in latencies), wait)


TOKEN_COUNTERS = (("fak_prompt_tokens", "Prompt tokens.", "prompt_tokens"),
                  ("fak_completion_tokens", "Generated tokens.", "completion_tokens"),
                  ("fak_cached_tokens", "Prompt tokens served from cache.", "cached_tokens"))
LATENCY_HISTOGRAMS = (("fak_time_to_first_token_seconds", "Time to first token.", "ttft"),
                      ("fak_e2e_request_latency_seconds", "End-to-end latency.", "e2e"))


def _add_histogram(family: HistogramMetricFamily, labels: dict[str, str],
                   histogram: LatencyHistogram) -> None:
    family.add_metric(list(labels.values()), histogram.buckets(), histogram.sum)
    family.add_sample(family.name + "_created", labels, histogram.created)


SYNC_STATES = ("synced", "uncertain", "stale")
RANK_GAUGES = (("in_flight", "fak_upstream_in_flight_requests", "Requests the governor has "
                "in flight on the rank."),
               ("engine_load", "fak_upstream_engine_load", "Running plus waiting requests on "
                "the rank, from its metrics."),
               ("index_blocks", "fak_upstream_kv_index_blocks", "Blocks in the rank's KV "
                "shadow index."))
RANK_COUNTERS = (("decisions", "fak_routing_decisions", "Requests routed to the rank."),
                 ("failovers", "fak_routing_failovers", "Requests retried elsewhere after "
                  "failing on the rank before the first byte."),
                 ("failures", "fak_routing_failures", "Requests that failed on the rank "
                  "before the first byte, retried elsewhere or not."),
                 ("predicted_cached_tokens", "fak_routing_predicted_cached_tokens",
                  "Cached prompt tokens the router predicted for the rank."),
                 ("cached_tokens", "fak_routing_reported_cached_tokens",
                  "Cached prompt tokens the rank reported for routed requests."),
                 ("predictions", "fak_routing_predictions", "Routed requests with both a "
                  "prediction and a reported cached_tokens."),
                 ("exact_predictions", "fak_routing_exact_predictions", "Of those, the ones "
                  "whose prediction equalled the reported cached_tokens."))


class FleetCollector(Collector):
    """Per upstream and rank (labels `upstream`, `rank`), read from the fleet at scrape
    time: health, KV-index sync state (one gauge per state, 1 for the current one), load,
    routing decisions and predicted against reported cached tokens."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def collect(self) -> Iterator[Metric]:  # type: ignore[override]
        views = self.fleet.upstream_views()
        up = GaugeMetricFamily("fak_upstream_up", "1 while the upstream takes traffic.",
                               labels=["upstream"])
        probes = CounterMetricFamily("fak_upstream_probes", "Capability probes run.",
                                     labels=["upstream"])
        sync = GaugeMetricFamily("fak_upstream_kv_sync_state", "KV-index sync state of the "
                                 "rank (1 for the current state).",
                                 labels=["upstream", "rank", "state"])
        gauges = {key: GaugeMetricFamily(name, text, labels=["upstream", "rank"])
                  for key, name, text in RANK_GAUGES}
        counters = {key: CounterMetricFamily(name, text, labels=["upstream", "rank"])
                    for key, name, text in RANK_COUNTERS}
        for view in views:
            up.add_metric([view["name"]], 1.0 if view["up"] else 0.0)
            probes.add_metric([view["name"]], view["probes"])
            for rank in view["ranks"]:
                self._rank(view["name"], rank, sync, gauges, counters)
        yield from (up, probes, sync, *gauges.values(), *counters.values())

    @staticmethod
    def _rank(name: str, rank: dict[str, Any], sync: GaugeMetricFamily,
              gauges: dict[str, GaugeMetricFamily],
              counters: dict[str, CounterMetricFamily]) -> None:
        labels = [name, str(rank["rank"])]
        for state in SYNC_STATES:
            sync.add_metric([*labels, state], 1.0 if rank["sync_state"] == state else 0.0)
        for key, family in gauges.items():
            if rank[key] is not None:
                family.add_metric(labels, rank[key])
        for key, counter in counters.items():
            counter.add_metric(labels, rank[key])


class GovernorMetrics:
    def __init__(self, fleet: Fleet | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.served = ServedCollector()
        r.register(self.served)
        self.rejections = Counter("fak_admission_rejections", "Requests refused before the "
                                  "engine, by reason.", ["tenant", "reason"], registry=r)
        self.client_salts = Counter("fak_client_cache_salt", "Client-supplied salts seen.",
                                    ["tenant", "action"], registry=r)
        self.client_salt_headers = Counter(
            "fak_client_salt_headers", "Requests carrying a namespace-picking header (dropped).",
            ["tenant"], registry=r)
        self.connections_refused = Counter(
            "fak_connections_refused", "Connections closed by the listener, by reason.",
            ["reason"], registry=r)
        self.serving_scrape_ok = Gauge(
            "fak_serving_scrape_ok", "1 when the last engine metrics scrape succeeded.",
            registry=r)
        self.in_flight = Gauge("fak_in_flight_requests", "Requests holding an engine slot.",
                               registry=r)
        self.queued = Gauge("fak_queued_requests", "Requests waiting for admission.", registry=r)
        self.serving = ServingCollector()
        r.register(self.serving)
        if fleet is not None:
            r.register(FleetCollector(fleet))
        # This process's CPU, memory and collector, read at scrape time: what a governor at
        # line rate spends, and its collections, each a pause of every request (issue 19).
        ProcessCollector(registry=r)
        GCCollector(registry=r)

    def for_tenant(self, tenant: str, tenant_class: str) -> TenantMeters:
        """The tenant's series (configured tenants only reach here: the memo is bounded)."""
        meters = self.served.tenants.get(tenant)
        if meters is None:
            meters = self.served.tenants[tenant] = TenantMeters(self, tenant, tenant_class)
        return meters

    def admission_wait_of(self, tenant_class: str) -> LatencyHistogram:
        """The class's admission-wait histogram, shared by its tenants."""
        histogram = self.served.admission_waits.get(tenant_class)
        if histogram is None:
            histogram = self.served.admission_waits[tenant_class] = LatencyHistogram()
        return histogram

    def set_serving(self, values: Mapping[str, float | int | None] | None) -> None:
        """The engine's last window; None (a failed scrape) drops it rather than show stale
        values as current."""
        self.serving_scrape_ok.set(0 if values is None else 1)
        self.serving.snapshot = {k: float(v) for k, v in (values or {}).items()
                                 if v is not None}

    def render(self) -> bytes:
        return generate_latest(self.registry)
