"""A governor over a fleet of two loopback servers answering like vLLM 0.32 (tests/adapters/
vllm_imitation.py), built from a `[[engine.upstreams]]` config: the upstreams' API keys
reach them (and never the config), `/admin/v1/upstreams` and the per-upstream metrics, and
a fleet quarantine (salt rotation) that is VERIFIED with every member's facts and
UNVERIFIED, naming the member, when one upstream is down."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from governor.auth import sha256_hex
from governor.config import ConfigError, parse_config
from governor.secrets import StartupRefused
from governor.serve import build_driver, build_governor, governor_salt_key
from governor.state import Governor
from tests.adapters.vllm_imitation import Imitation, start_imitation
from tests.governor.loop_probe import health_latencies
from tests.governor.server_thread import ServerThread
from tests.http_client import HTTP

ADMIN = "fleet-admin-token"
KEY = "fleet-acme-key"


@dataclass
class Stack:
    thread: ServerThread
    gov: Governor
    url: str
    states: dict[str, Imitation]
    runners: dict[str, object]


def fleet_config(tmp: Path, urls: dict[str, str]) -> dict:
    return {
        "server": {"data_dir": str(tmp / "data"), "admin_token_sha256": sha256_hex(ADMIN)},
        "engine": {"kind": "vllm", "routing": {"policy": "round_robin",
                                               "health_interval_s": 0.05,
                                               "backoff_max_s": 0.2},
                   "upstreams": [
                       {"name": "a", "base_url": urls["a"], "api_key_env": "FAK_TEST_KEY_A",
                        "declare": {"prompt_tokens_details": True}},
                       {"name": "b", "base_url": urls["b"],
                        "api_key_file": str(tmp / "b.key"), "data_parallel_size": 2,
                        "declare": {"prompt_tokens_details": True}}]},
        "tenants": [{"id": "acme", "api_key_sha256": [sha256_hex(KEY)]}]}


@contextlib.contextmanager
def fleet_stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                **routing: object) -> Iterator[Stack]:
    """The governor over two imitations; `routing`: `[engine.routing]` keys to change."""
    thread = ServerThread()
    states = {"a": Imitation(), "b": Imitation()}
    started = {n: thread.run(start_imitation(s)) for n, s in states.items()}
    monkeypatch.setenv("FAK_TEST_KEY_A", "upstream-a-secret")
    (tmp_path / "b.key").write_text("upstream-b-secret\n")
    raw = fleet_config(tmp_path, {n: u for n, (_, u) in started.items()})
    raw["engine"]["routing"].update(routing)
    config = parse_config(raw)
    driver = build_driver(config, governor_salt_key(config, create_key=True))
    thread.run(driver.start())
    gov = build_governor(config, driver, create_key=False)
    stack = Stack(thread, gov, thread.serve(gov), states, {n: r for n, (r, _) in
                                                           started.items()})
    try:
        yield stack
    finally:
        thread.run(driver.close())
        for runner in stack.runners.values():
            thread.run(runner.cleanup())  # type: ignore[attr-defined]
        thread.stop()
        gov.audit.close()


@pytest.fixture
def stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Stack]:
    with fleet_stack(tmp_path, monkeypatch) as built:
        yield built


def test_keys_views_and_metrics(stack: Stack) -> None:
    for i in range(6):
        r = HTTP.post(f"{stack.url}/v1/completions", timeout=30,
                      headers={"Authorization": f"Bearer {KEY}"},
                      json={"prompt": f"hello there {i}", "max_tokens": 1})
        assert r.status_code == 200, r.text
    for name, secret in (("a", "upstream-a-secret"), ("b", "upstream-b-secret")):
        auth = {h.get("authorization") for _, p, h, _ in stack.states[name].received
                if p.startswith("/v1/")}
        assert auth == {f"Bearer {secret}"}, name
    ranks = [h.get("x-data-parallel-rank") for _, p, h, b in stack.states["b"].received
             if p == "/v1/completions" and isinstance(b, dict)
             and str(b.get("prompt", "")).startswith("hello")]
    assert sorted(set(ranks)) == ["0", "1"]  # b's two ranks, addressed by the header
    r = HTTP.get(f"{stack.url}/admin/v1/upstreams", timeout=10,
                 headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200
    body = r.json()
    assert [u["name"] for u in body["data"]] == ["a", "b"]
    assert [len(u["ranks"]) for u in body["data"]] == [1, 2]
    assert body["routing"]["policy"] == "round_robin" and body["routing"]["decisions"] == 6
    wall, cpu = body["routing"]["decision_p50_ms"], body["routing"]["decision_cpu_p50_ms"]
    assert 0 < cpu <= wall + 0.01, body["routing"]  # the thread's CPU time within the wall
    assert "secret" not in r.text
    assert HTTP.get(f"{stack.url}/admin/v1/upstreams", timeout=10).status_code == 401
    text = HTTP.get(stack.thread.metrics_urls[stack.url] + "/metrics", timeout=10).text
    decisions = {tuple(sorted(s.labels.items())): s.value
                 for f in text_string_to_metric_families(text) for s in f.samples
                 if s.name == "fak_routing_decisions_total"}
    assert decisions == {(("rank", "0"), ("upstream", "a")): 2.0,
                         (("rank", "0"), ("upstream", "b")): 2.0,
                         (("rank", "1"), ("upstream", "b")): 2.0}


def quarantine(stack: Stack) -> dict:
    r = HTTP.post(f"{stack.url}/admin/v1/quarantine", timeout=60,
                  headers={"Authorization": f"Bearer {ADMIN}"},
                  json={"tenant": "acme", "span": {"text": " ".join(["word"] * 300)},
                         "reason": "fleet-test"})
    assert r.status_code == 200, r.text
    return r.json()


def test_fleet_rotation_verified_only_with_every_member(stack: Stack) -> None:
    record = quarantine(stack)
    assert record["plan"] == "salt_rotation" and record["state"] == "VERIFIED", record
    for member in ("a/0", "b/0", "b/1"):
        assert f"member={member}:state=verified" in record["reasons"]
        assert f"member={member}:control=256" in record["reasons"]
        assert f"member={member}:after=0" in record["reasons"]
    stack.thread.run(stack.runners["b"].cleanup())  # type: ignore[attr-defined]
    upstream = stack.gov.driver.upstream("b")  # type: ignore[attr-defined]
    deadline = time.monotonic() + 10
    while upstream.up and time.monotonic() < deadline:
        time.sleep(0.05)
    record = quarantine(stack)
    assert record["state"] == "UNVERIFIED"
    assert "member=b/1:state=unverified" in record["reasons"]
    assert "member=b/0:engine=member_down" in record["reasons"]
    assert "member=a/0:state=verified" in record["reasons"]


def test_missing_upstream_keys_and_bad_fleets_refuse_start_up(tmp_path: Path) -> None:
    urls = {"a": "http://127.0.0.1:9", "b": "http://127.0.0.1:10"}
    config = parse_config(fleet_config(tmp_path, urls))
    with pytest.raises(StartupRefused, match=r"upstream a: no API key in \$FAK_TEST_KEY_A"):
        build_driver(config, governor_salt_key(config, create_key=True))
    raw = fleet_config(tmp_path, urls)
    raw["engine"]["upstreams"][1]["name"] = "a"
    with pytest.raises(ConfigError, match="unique"):
        parse_config(raw)
    raw = fleet_config(tmp_path, urls)
    raw["engine"]["upstreams"][0]["api_key"] = "inline-secret"
    with pytest.raises(ConfigError, match="api_key"):
        parse_config(raw)


def test_a_long_prompt_is_routed_while_the_governor_answers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """KV-aware routing tokenises an 800 KiB prompt on a worker thread: /health keeps
    answering meanwhile (on the loop, the routing decision held it for all of it: 0.675 s
    of a 0.71 s request)."""
    with fleet_stack(tmp_path, monkeypatch, policy="kv_aware", tokenizer="embedded") as st:
        stop, health = threading.Event(), []
        pinger = threading.Thread(target=health_latencies, args=(st.url, stop, health))
        pinger.start()
        time.sleep(0.2)
        started_at = time.perf_counter()
        r = HTTP.post(f"{st.url}/v1/completions", timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"},
                      json={"prompt": "a " * 400_000, "max_tokens": 1})
        took = time.perf_counter() - started_at
        stop.set()
        pinger.join()
        assert r.status_code == 200, r.text[:300]
        assert max(health) < took / 2, (max(health), took)
        routing = HTTP.get(f"{st.url}/admin/v1/upstreams",
                           headers={"Authorization": f"Bearer {ADMIN}"}).json()["routing"]
        assert routing["policy"] == "kv_aware" and routing["decisions"] == 1


RUNNING = 'vllm:num_requests_running{engine="0",model_name="smollm2"} 0.0'
WAITING = 'vllm:num_requests_waiting{engine="0",model_name="smollm2"} 0.0'
TTFT_BUCKET = 'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="smollm2"}'


def upstream_a(stack: Stack, until: Callable[[dict], bool]) -> dict:
    """Upstream a's admin view once `until` holds for it (health checks every 0.05 s)."""
    deadline = time.monotonic() + 10
    while True:
        view = HTTP.get(f"{stack.url}/admin/v1/upstreams", timeout=10,
                        headers={"Authorization": f"Bearer {ADMIN}"}).json()["data"][0]
        if until(view) or time.monotonic() > deadline:
            return view
        time.sleep(0.05)


def test_health_checks_read_the_engines_loads_from_their_gauges_alone(stack: Stack) -> None:
    """Each check scrapes the upstream's loads (running + waiting); a broken line outside
    those gauges is not parsed (a histogram's here), a broken load gauge is a failed check."""
    imitation = stack.states["a"]
    assert RUNNING in imitation.metrics_text() and TTFT_BUCKET in imitation.metrics_text()
    imitation.metrics_edit = lambda text: text.replace(RUNNING, RUNNING[:-3] + "3.0").replace(
        WAITING, WAITING[:-3] + "2.0").replace(TTFT_BUCKET, TTFT_BUCKET[:-1] + "{ broken")
    view = upstream_a(stack, lambda v: v["ranks"][0]["engine_load"] == 5.0)
    assert view["up"] and view["ranks"][0]["engine_load"] == 5.0, view
    imitation.metrics_edit = lambda text: text.replace(RUNNING, RUNNING[:-3] + "-1.0")
    view = upstream_a(stack, lambda v: not v["up"])
    assert not view["up"] and view["refusal"].startswith("health check failed"), view
