"""Metrics normaliser on the real 0.32.0 captures, older name generations, and garbage."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.vllm.metrics import (
    READ_FAMILIES,
    MetricsParseError,
    histogram_quantile,
    loads_from_text,
    parse_samples,
    read_lines,
    serving_metrics,
    snapshot_from_text,
)
from tests.adapters.vllm_vectors import INT_RUN, RUNS


def sample_value(text: str, prefix: str) -> float:
    """Independent reading: the value of the one line starting with `prefix`."""
    (line,) = [ln for ln in text.splitlines() if ln.startswith(prefix)]
    return float(line.rsplit(" ", 1)[1])


@pytest.fixture(scope="module")
def captures() -> tuple[str, str]:
    return (INT_RUN / "metrics_before.prom").read_text(), (
        INT_RUN / "metrics_after.prom"
    ).read_text()


def test_real_capture_window(captures) -> None:
    before_text, after_text = captures
    before, after = snapshot_from_text(before_text), snapshot_from_text(after_text)
    window = serving_metrics(after, before)
    queries = sample_value(after_text, "vllm:prefix_cache_queries_total{") - sample_value(
        before_text, "vllm:prefix_cache_queries_total{"
    )
    hits = sample_value(after_text, "vllm:prefix_cache_hits_total{") - sample_value(
        before_text, "vllm:prefix_cache_hits_total{"
    )
    assert (
        (window.prefix_cache_queries, window.prefix_cache_hits) == (queries, hits) == (9402, 1280)
    )
    assert window.prefix_cache_hit_ratio == pytest.approx(1280 / 9402)
    assert window.cached_tokens == sample_value(after_text, "vllm:prompt_tokens_cached_total{")
    assert window.generation_tokens == 120 and window.prompt_tokens == 9402
    assert (window.running, window.waiting, window.kv_usage, window.preemptions) == (0, 0, 0, 0)
    assert after.block_size == 128
    # 21 TTFT observations: 2 ≤ 0.06, 4 ≤ 0.08, 4 ≤ 0.1, 21 ≤ 0.25
    assert window.ttft_p50 == pytest.approx(0.1 + 0.15 * (10.5 - 4) / 17)
    assert window.ttft_p99 == pytest.approx(0.1 + 0.15 * (20.79 - 4) / 17)
    assert 0.025 < window.itl_p50 <= 0.05


def test_empty_window_ratio_is_none_not_zero(captures) -> None:
    before = snapshot_from_text(captures[0])
    window = serving_metrics(before, before)
    assert window.prefix_cache_queries == 0 and window.prefix_cache_hit_ratio is None
    assert window.ttft_p50 is None


OLD_GENERATION = """\
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.25
# TYPE vllm:gpu_prefix_cache_queries counter
vllm:gpu_prefix_cache_queries_total{model_name="m"} 100.0
# TYPE vllm:gpu_prefix_cache_hits counter
vllm:gpu_prefix_cache_hits_total{model_name="m"} 40.0
# TYPE vllm:time_per_output_token_seconds histogram
vllm:time_per_output_token_seconds_bucket{le="0.1",model_name="m"} 10.0
vllm:time_per_output_token_seconds_bucket{le="+Inf",model_name="m"} 10.0
vllm:time_per_output_token_seconds_count{model_name="m"} 10.0
vllm:time_per_output_token_seconds_sum{model_name="m"} 0.5
"""


def test_old_generation_names_map_to_the_same_fields() -> None:
    metrics = serving_metrics(snapshot_from_text(OLD_GENERATION))
    assert metrics.kv_usage == 0.25
    assert metrics.prefix_cache_hit_ratio == pytest.approx(0.4)
    assert metrics.itl_p50 == pytest.approx(0.05)
    assert metrics.cached_tokens is None and metrics.running is None


def test_new_name_wins_and_engines_sum() -> None:
    text = """\
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.9
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.2
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.4
vllm:num_requests_running{engine="0",model_name="m"} 2
vllm:num_requests_running{engine="1",model_name="m"} 3
vllm:num_requests_running{engine="0",model_name="other"} 50
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 10
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 30
"""
    snapshot = snapshot_from_text(text, model="m")
    assert snapshot.gauges["kv_usage"] == pytest.approx(0.3)
    assert snapshot.gauges["running"] == 5
    metrics = serving_metrics(snapshot)
    assert metrics.prefix_cache_queries == 40 and metrics.prefix_cache_hit_ratio is None


def test_counter_reset_starts_the_window_at_the_reset() -> None:
    before = snapshot_from_text(
        "vllm:prefix_cache_queries_total 100\nvllm:prefix_cache_hits_total 90\n"
    )
    after = snapshot_from_text(
        "vllm:prefix_cache_queries_total 10\nvllm:prefix_cache_hits_total 5\n"
    )
    assert serving_metrics(after, before).prefix_cache_hit_ratio == pytest.approx(0.5)


def test_histogram_quantile_edges() -> None:
    assert histogram_quantile(0.5, None) is None
    assert histogram_quantile(0.5, ((1.0, 0.0), (math.inf, 0.0))) is None
    assert histogram_quantile(0.99, ((1.0, 1.0), (math.inf, 10.0))) == 1.0
    assert histogram_quantile(0.5, ((1.0, 4.0), (2.0, 8.0), (math.inf, 8.0))) == 1.0


@pytest.mark.parametrize("name", ["metrics_before.prom", "metrics_after.prom"])
@pytest.mark.parametrize("run", RUNS, ids=lambda r: r.name)
def test_the_read_families_parse_alike_from_their_lines_alone(run, name: str) -> None:
    """The parser gets only the read families' lines; on the real expositions they give
    every sample they give from the whole text, and far fewer lines are parsed."""
    text = (run / name).read_text()
    whole, cut = parse_samples(text), parse_samples(read_lines(text))
    read = {k: v for k, v in whole.items() if k.startswith(READ_FAMILIES)}
    assert cut == read and read
    assert len(read_lines(text).splitlines()) * 3 < len(text.splitlines())


def test_lines_of_other_families_are_not_parsed() -> None:
    """Garbage outside the read families is never read; inside them it still raises."""
    running = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 3\n"
    snapshot = snapshot_from_text("vllm:other{le= 1\n# TYPE vllm:other gauge\n" + running)
    assert snapshot.gauges["running"] == 3
    with pytest.raises(MetricsParseError):
        snapshot_from_text(running + "vllm:num_requests_waiting{le= 1\n")


@pytest.mark.parametrize("name", ["metrics_before.prom", "metrics_after.prom"])
@pytest.mark.parametrize("run", RUNS, ids=lambda r: r.name)
def test_the_loads_alone_match_the_whole_snapshots(run, name: str) -> None:
    text = (run / name).read_text()
    loads = loads_from_text(text, "smollm2")
    assert loads is not None and loads == snapshot_from_text(text, "smollm2").engine_load


def test_loads_per_engine_read_from_their_gauges_alone() -> None:
    """Running plus waiting per `engine`, of the model asked for; a broken line of another
    family is not read, a broken or negative load is a parse error."""
    text = """\
vllm:num_requests_running{engine="0",model_name="m"} 2
vllm:num_requests_running{engine="1",model_name="m"} 3
vllm:num_requests_waiting{engine="1",model_name="m"} 4
vllm:num_requests_waiting_by_reason{engine="1",model_name="m",reason="capacity"} 4
vllm:num_requests_running{engine="0",model_name="other"} 50
vllm:time_to_first_token_seconds_bucket{le= 1
"""
    assert loads_from_text(text, "m") == {"0": 2.0, "1": 7.0}
    assert loads_from_text(text) == {"0": 52.0, "1": 7.0}
    assert loads_from_text("vllm:kv_cache_usage_perc 0.5\n") is None
    for broken in ("vllm:num_requests_waiting{le= 1\n", "vllm:num_requests_running -1\n",
                   "vllm:num_requests_running NaN\n"):
        with pytest.raises(MetricsParseError):
            loads_from_text(text + broken)


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=200))
def test_fuzz_loads(garbage: str) -> None:
    try:
        loads = loads_from_text("vllm:num_requests_running" + garbage)
    except MetricsParseError:
        return
    assert loads is None or all(0 <= v < math.inf for v in loads.values())


def test_garbage_raises_the_parse_error() -> None:
    with pytest.raises(MetricsParseError):
        snapshot_from_text("vllm:num_requests_running{le= 1\n")
    with pytest.raises(MetricsParseError):
        snapshot_from_text('vllm:time_to_first_token_seconds_bucket{le="abc"} 1\n')


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=200))
def test_fuzz_parser_wrapper(garbage: str) -> None:
    try:
        snapshot = snapshot_from_text(garbage)
    except MetricsParseError:
        return
    serving_metrics(snapshot, snapshot)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            [
                "vllm:prefix_cache_hits_total",
                "vllm:time_to_first_token_seconds_bucket",
                "vllm:kv_cache_usage_perc",
                '{le="',
                '"}',
                " ",
                "1",
                "+Inf",
                "NaN",
                "\n",
                "# TYPE ",
                " counter",
                "histogram",
            ]
        ),
        max_size=30,
    )
)
def test_fuzz_near_valid_expositions(parts: list[str]) -> None:
    try:
        snapshot = snapshot_from_text("".join(parts))
    except MetricsParseError:
        return
    serving_metrics(snapshot, snapshot)
