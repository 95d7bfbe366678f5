"""The governor's own Prometheus metrics, per tenant, on a private registry."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

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


class GovernorMetrics:
    def __init__(self) -> None:
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

    def set_serving(self, values: Mapping[str, float | int | None] | None) -> None:
        """The engine's last window; None (a failed scrape) drops it rather than show stale
        values as current."""
        self.serving_scrape_ok.set(0 if values is None else 1)
        self.serving.snapshot = {k: float(v) for k, v in (values or {}).items()
                                 if v is not None}

    def render(self) -> bytes:
        return generate_latest(self.registry)
