"""The governor's own Prometheus metrics, per tenant, on a private registry."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

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


class TenantMeters:
    """One tenant's labelled series, looked up once: `labels()` takes a lock and builds its
    key on every call, which the hot path need not pay per request."""

    def __init__(self, metrics: GovernorMetrics, tenant: str, tenant_class: str) -> None:
        self._requests_of = metrics.requests
        self._tenant = tenant
        self._requests: dict[tuple[str, str], Counter] = {}  # (route, outcome): bounded
        self.prompt_tokens = metrics.prompt_tokens.labels(tenant)
        self.completion_tokens = metrics.completion_tokens.labels(tenant)
        self.cached_tokens = metrics.cached_tokens.labels(tenant)
        self.ttft = metrics.ttft.labels(tenant)
        self.e2e = metrics.e2e.labels(tenant)
        self.admission_wait = metrics.admission_wait.labels(tenant_class)

    def requests(self, route: str, outcome: str) -> Counter:
        child = self._requests.get((route, outcome))
        if child is None:
            child = self._requests[(route, outcome)] = self._requests_of.labels(
                self._tenant, route, outcome)
        return child


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
        self.requests = Counter("fak_requests", "Requests by tenant, route and outcome.",
                                ["tenant", "route", "outcome"], registry=r)
        self.prompt_tokens = Counter("fak_prompt_tokens", "Prompt tokens.", ["tenant"],
                                     registry=r)
        self.completion_tokens = Counter("fak_completion_tokens", "Generated tokens.",
                                         ["tenant"], registry=r)
        self.cached_tokens = Counter("fak_cached_tokens", "Prompt tokens served from cache.",
                                     ["tenant"], registry=r)
        self.ttft = Histogram("fak_time_to_first_token_seconds", "Time to first token.",
                              ["tenant"], buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("fak_e2e_request_latency_seconds", "End-to-end latency.",
                             ["tenant"], buckets=LATENCY_BUCKETS, registry=r)
        self.admission_wait = Histogram("fak_admission_wait_seconds", "Time queued for a slot.",
                                        ["tenant_class"], buckets=LATENCY_BUCKETS, registry=r)
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
        self._meters: dict[str, TenantMeters] = {}

    def for_tenant(self, tenant: str, tenant_class: str) -> TenantMeters:
        """The tenant's series (configured tenants only reach here: the memo is bounded)."""
        meters = self._meters.get(tenant)
        if meters is None:
            meters = self._meters[tenant] = TenantMeters(self, tenant, tenant_class)
        return meters

    def set_serving(self, values: Mapping[str, float | int | None] | None) -> None:
        """The engine's last window; None (a failed scrape) drops it rather than show stale
        values as current."""
        self.serving_scrape_ok.set(0 if values is None else 1)
        self.serving.snapshot = {k: float(v) for k, v in (values or {}).items()
                                 if v is not None}

    def render(self) -> bytes:
        return generate_latest(self.registry)
