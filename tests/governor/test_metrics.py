"""The governor's per-request series (plain numbers read at scrape time) against
prometheus_client's own Counter and Histogram: the same exposition for the same updates."""

from __future__ import annotations

import gc

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from governor.metrics import LATENCY_BUCKETS, GovernorMetrics

SECONDS = st.one_of(st.sampled_from([0.0, *LATENCY_BUCKETS]),
                    st.floats(min_value=0.0, max_value=1000.0, allow_nan=False))


def samples(text: bytes) -> list[tuple[str, tuple[tuple[str, str], ...], float]]:
    """Every sample but the `_created` ones (wall-clock times of two objects)."""
    families = text_string_to_metric_families(text.decode())
    return [(s.name, tuple(sorted(s.labels.items())), s.value) for family in families
            for s in family.samples if not s.name.endswith("_created")]


def reference(tenant: str, served: list[tuple[str, str]], e2e: list[float],
              tokens: list[int]) -> bytes:
    registry = CollectorRegistry()
    requests = Counter("fak_requests", "Requests by tenant, route and outcome.",
                       ["tenant", "route", "outcome"], registry=registry)
    prompt = Counter("fak_prompt_tokens", "Prompt tokens.", ["tenant"], registry=registry)
    latency = Histogram("fak_e2e_request_latency_seconds", "End-to-end latency.",
                        ["tenant"], buckets=LATENCY_BUCKETS, registry=registry)
    prompt.labels(tenant)
    latency.labels(tenant)
    for route, outcome in served:
        requests.labels(tenant, route, outcome).inc()
    for seconds in e2e:
        latency.labels(tenant).observe(seconds)
    for n in tokens:
        prompt.labels(tenant).inc(n)
    return generate_latest(registry)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["chat", "completions"]),
                          st.sampled_from(["ok", "engine_error", "client_disconnect"]))),
       st.lists(SECONDS, max_size=40), st.lists(st.integers(0, 10_000), max_size=10))
def test_the_exposition_is_prometheus_clients(served: list[tuple[str, str]],
                                              e2e: list[float], tokens: list[int]) -> None:
    metrics = GovernorMetrics()
    meters = metrics.for_tenant("acme", "standard")
    for route, outcome in served:
        meters.count_request(route, outcome)
    for seconds in e2e:
        meters.e2e.observe(seconds)
    for n in tokens:
        meters.prompt_tokens += n
    ours = samples(metrics.render())
    wanted = samples(reference("acme", served, e2e, tokens))
    names = {name for name, _, _ in wanted}
    assert sorted(s for s in ours if s[0] in names) == sorted(wanted)


def test_every_family_is_listed_before_the_first_request_and_classes_share_a_wait() -> None:
    metrics = GovernorMetrics()
    text = metrics.render().decode()
    for name in ("fak_requests", "fak_prompt_tokens", "fak_completion_tokens",
                 "fak_cached_tokens", "fak_time_to_first_token_seconds",
                 "fak_e2e_request_latency_seconds", "fak_admission_wait_seconds"):
        assert f"# TYPE {name}" in text
    a = metrics.for_tenant("a", "premium")
    b = metrics.for_tenant("b", "premium")
    assert a.admission_wait is b.admission_wait
    assert metrics.for_tenant("a", "premium") is a
    a.admission_wait.observe(0.5)
    b.admission_wait.observe(0.002)
    rendered = metrics.render().decode()
    assert 'fak_admission_wait_seconds_count{tenant_class="premium"} 2.0' in rendered
    assert 'fak_admission_wait_seconds_bucket{le="0.005",tenant_class="premium"} 1.0' in rendered
    assert 'fak_cached_tokens_created{tenant="b"}' in rendered


def test_the_process_and_its_collector_are_exposed() -> None:
    metrics = GovernorMetrics()
    before = {(s[0], s[1]): s[2] for s in samples(metrics.render())}
    gc.collect()
    after = {(s[0], s[1]): s[2] for s in samples(metrics.render())}
    full = ("python_gc_collections_total", (("generation", "2"),))
    assert after[full] == before[full] + 1
    assert after[("process_cpu_seconds_total", ())] > 0
    assert after[("process_resident_memory_bytes", ())] > 0
