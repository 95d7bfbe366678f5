"""A real fleet on loopback behind one governor (issue 14): the session's vLLM 0.32 CPU
server plus two `fak engine serve` replicas (one with `--data-parallel-size 2`, both with
`--api-key`), started from the fleet example in docs/operations.md §12 as written — only
the addresses (and the key file's path) point at the servers started here.

- SEC-2/3/4 hold on every rank;
- a tenant's repeated prefix lands where it is cached: the prediction equals the reported
  cached_tokens in >= 95% of requests;
- a fleet quarantine is VERIFIED only with every member's facts, UNVERIFIED once one
  rank's KV stream is cut;
- killing a replica mid-run loses no request that had not started streaming;
- a restarted replica gets traffic only after it was re-probed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import random
import signal
import time
import tomllib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from adapters.fleet.driver import FleetDriver
from adapters.vllm.kv_subscriber import SyncState
from governor.config import parse_config
from governor.serve import build_driver, build_governor, governor_salt_key
from governor.state import Governor
from policies.salts import tenant_salt
from schemas.engine import EngineRequest
from tests.governor.server_thread import ServerThread
from tests.http_client import HTTP

from .native_server import (
    NativeServer,
    NativeServerConfig,
    _free_runs,
    start_native_server,
    stop_native_server,
)
from .tcp_relay import TcpRelay
from .vllm_server import REPO_ROOT, VllmServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DOC = REPO_ROOT / "docs" / "operations.md"
KEYS = {"acme": "example-acme-key", "beta": "example-beta-key"}
ADMIN = {"Authorization": "Bearer example-admin-token"}
BLOCK = 32  # every engine of the suite runs blocks of 32 tokens


def fleet_example() -> dict[str, Any]:
    """The TOML block of docs/operations.md §12, parsed."""
    section = DOC.read_text().split("## 12. A fleet", 1)[1]
    start = section.index("```toml\n") + len("```toml\n")
    return tomllib.loads(section[start:section.index("```", start)])


@dataclass
class Fleet:
    thread: ServerThread
    gov: Governor
    url: str
    natives: dict[str, NativeServer]
    relays: list[TcpRelay]
    keys: dict[str, str]

    @property
    def driver(self) -> FleetDriver:
        assert isinstance(self.gov.driver, FleetDriver)
        return self.gov.driver

    def post(self, tenant: str, route: str, body: dict[str, Any]) -> httpx.Response:
        return HTTP.post(f"{self.url}/v1/{route}", json=body, timeout=300,
                         headers={"Authorization": f"Bearer {KEYS[tenant]}"})

    def upstreams(self) -> list[dict[str, Any]]:
        r = HTTP.get(f"{self.url}/admin/v1/upstreams", headers=ADMIN, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["data"]


def point_at(raw: dict[str, Any], servers: dict[str, Any], relay_base: int,
             key_file: Path) -> dict[str, Any]:
    """The example with its addresses replaced by the started servers' (nothing else)."""
    upstreams = {u["name"]: u for u in raw["engine"]["upstreams"]}
    assert set(upstreams) == {"vllm-a", "native-b", "native-c"}
    for name, server in servers.items():
        port = server.kv_endpoint.rsplit(":", 1)[1]
        upstreams[name].update(base_url=server.base_url, kv_events=f"tcp://*:{port}",
                               kv_replay=server.replay_endpoint)
    upstreams["vllm-a"]["metrics_url"] = servers["vllm-a"].base_url + "/metrics"
    upstreams["native-b"]["kv_events"] = f"tcp://*:{relay_base}"  # through cuttable relays
    upstreams["native-c"]["api_key_file"] = str(key_file)
    return raw


@pytest.fixture(scope="module")
def fleet(vllm_server: VllmServer, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("fleet")
    keys = {"native-b": f"key-b-{uuid.uuid4().hex}", "native-c": f"key-c-{uuid.uuid4().hex}"}
    configs = {"native-b": NativeServerConfig(data_parallel_size=2, api_key=keys["native-b"],
                                              cache_control_token=None),
               "native-c": NativeServerConfig(api_key=keys["native-c"],
                                              cache_control_token=None)}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        started = dict(zip(configs, pool.map(start_native_server, configs.values()),
                           strict=True))
    thread = ServerThread()
    (relay_base,) = _free_runs(1, 2)
    b_kv = int(started["native-b"].kv_endpoint.rsplit(":", 1)[1])
    relays = [TcpRelay(relay_base + r, b_kv + r) for r in (0, 1)]
    for relay in relays:
        thread.run(relay.start())
    key_file = tmp / "native-c.key"
    key_file.write_text(keys["native-c"] + "\n")
    os.environ["FAK_NATIVE_B_KEY"] = keys["native-b"]
    raw = point_at(fleet_example(), {"vllm-a": vllm_server, **started}, relay_base, key_file)
    raw["server"]["data_dir"] = str(tmp / "data")
    config = parse_config(raw)
    driver = build_driver(config, governor_salt_key(config, create_key=True))
    thread.run(driver.start())
    gov = build_governor(config, driver, create_key=False)
    state = Fleet(thread, gov, thread.serve(gov), started, relays, keys)
    try:
        yield state
    finally:
        thread.run(driver.close())
        for relay in relays:
            thread.run(relay.cut())
        thread.stop()
        gov.audit.close()
        for server in state.natives.values():
            stop_native_server(server)
        os.environ.pop("FAK_NATIVE_B_KEY", None)


def tokens(count: int) -> list[int]:
    rng = random.Random(uuid.uuid4().int)
    return [rng.randrange(1000, 40000) for _ in range(count)]


def wait(predicate: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached in time")


def test_the_documented_fleet_is_probed_and_listed(fleet: Fleet) -> None:
    views = {u["name"]: u for u in fleet.upstreams()}
    assert list(views) == ["vllm-a", "native-b", "native-c"]
    assert [len(v["ranks"]) for v in views.values()] == [1, 2, 1]
    for view in views.values():
        assert view["up"] and view["probes"] >= 1, view
        caps = view["capabilities"]
        assert caps["prefix_caching_hash_algo"] == "sha256_cbor" and "cache_salt" in caps["probed"]
    caps = fleet.driver.capabilities
    assert caps.prefix_reset and caps.cached_tokens_in_usage and not caps.exact_span_evict
    # The replicas really require their keys: the fleet passed them.
    b = fleet.natives["native-b"]
    assert HTTP.get(f"{b.base_url}/v1/models", timeout=10).status_code == 401
    assert HTTP.get(f"{b.base_url}/v1/models", timeout=10, headers={
        "Authorization": f"Bearer {fleet.keys['native-b']}"}).status_code == 200
    samples = metric_samples(fleet)
    assert samples[("fak_upstream_up", (("upstream", "native-b"),))] == 1.0
    assert ("fak_upstream_kv_sync_state", (("rank", "1"), ("state", "synced"),
                                           ("upstream", "native-b"))) in samples


def metric_samples(fleet: Fleet) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = HTTP.get(fleet.thread.metrics_urls[fleet.url] + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_sec2_sec3_sec4_hold_on_every_rank(fleet: Fleet) -> None:
    gov, driver = fleet.gov, fleet.driver
    unsalted = {m.name: m.upstream.driver.kv.index(m.rank).resident(None)  # type: ignore
                for m in driver.members}
    r = fleet.post("acme", "completions", {"prompt": "hi", "max_tokens": 1, "cache_salt": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"  # SEC-2
    before = {m.name: m.decisions for m in driver.members}
    for i in range(8):  # fresh prompts: no overlap anywhere, so ties rotate over every rank
        for tenant in KEYS:
            r = fleet.post(tenant, "completions", {"prompt": tokens(2 * BLOCK + 3),
                                                   "max_tokens": 1})
            assert r.status_code == 200, r.text
        if all(m.decisions > before[m.name] for m in driver.members) and i >= 1:
            break
    assert all(m.decisions > before[m.name] for m in driver.members)
    salts = {tenant_salt(gov.salt_key, t, gov.epochs.get(t)) for t in KEYS}
    for member in driver.members:  # SEC-3: nothing unsalted; governed blocks carry a salt
        index = member.upstream.driver.kv.index(member.rank)  # type: ignore[union-attr]
        assert index.resident(None) <= unsalted[member.name], member.name
        index.check_integrity()
    assert all(m.sync_state() is SyncState.SYNCED for m in driver.members)
    samples = metric_samples(fleet)
    for member in driver.members:
        labels = (("rank", str(member.rank)), ("upstream", member.upstream.name))
        assert samples[("fak_routing_decisions_total", labels)] == member.decisions
        assert samples[("fak_upstream_kv_sync_state", (labels[0], ("state", "synced"),
                                                       labels[1]))] == 1.0
    for member in driver.members:  # SEC-4 on each rank, with the governor's own salts
        prompt = tokens(3 * BLOCK + 1)
        cached = [usage(fleet, member, prompt, t) for t in ("acme", "acme", "beta")]
        assert cached[0] == 0 and cached[1] == 3 * BLOCK and cached[2] == 0, (member.name,
                                                                              cached)
    assert salts  # both tenants' salts were used above


def usage(fleet: Fleet, member: Any, prompt: list[int], tenant: str) -> int:
    request = EngineRequest.of(uuid.uuid4().hex, "completions",
                               {"prompt": prompt, "max_tokens": 1, "model": "smollm2"},
                               tenant, fleet.gov.salt_for(tenant))

    async def run() -> int:
        chunks = [c async for c in member.upstream.driver.generate(request,
                                                                  dp_rank=member.rank_header)]
        return chunks[-1].usage.cached_tokens

    return fleet.thread.run(run())


def test_a_repeated_prefix_lands_where_it_is_cached(fleet: Fleet) -> None:
    driver = fleet.driver
    before = sum(m.predictions for m in driver.members), sum(
        m.exact_predictions for m in driver.members)
    reported = []
    for tenant in KEYS:
        for _ in range(4):
            prompt = tokens(3 * BLOCK + 1)
            for send in range(3):
                r = fleet.post(tenant, "completions", {"prompt": prompt, "max_tokens": 1})
                assert r.status_code == 200, r.text
                reported.append((send, r.json()["usage"]["prompt_tokens_details"]
                                 ["cached_tokens"]))
                if send == 0:  # let the KV events of the first send reach the indexes
                    salt = fleet.gov.salt_for(tenant)
                    wait(lambda p=prompt, s=salt: any(
                        m.upstream.driver.kv.index(m.rank).prefix_blocks(s, p, BLOCK) == 3
                        for m in driver.members), 10)
    predictions = sum(m.predictions for m in driver.members) - before[0]
    exact = sum(m.exact_predictions for m in driver.members) - before[1]
    assert predictions == len(reported) == 24
    print(f"fleet: predicted == reported cached_tokens in {exact}/{predictions} requests")
    assert exact / predictions >= 0.95, (exact, predictions, reported)
    assert all(c == 3 * BLOCK for send, c in reported if send > 0), reported


def quarantine(fleet: Fleet) -> dict[str, Any]:
    text = " ".join(random.choice("abcdefgh") for _ in range(3 * BLOCK))
    r = HTTP.post(f"{fleet.url}/admin/v1/quarantine", headers=ADMIN, timeout=600, json={
        "tenant": "acme", "span": {"text": text}, "reason": "issue-14-test"})
    assert r.status_code == 200, r.text
    return r.json()


def member_states(record: dict[str, Any]) -> dict[str, str]:
    return {reason.split(":")[0].split("=", 1)[1]: reason.rsplit("=", 1)[1]
            for reason in record["reasons"] if reason.startswith("member=")
            and ":state=" in reason}


def test_fleet_quarantine_verified_with_every_members_facts(fleet: Fleet) -> None:
    record = quarantine(fleet)
    assert record["plan"] == "whole_prefix_flush"
    assert member_states(record) == {"vllm-a/0": "verified", "native-b/0": "verified",
                                     "native-b/1": "verified", "native-c/0": "verified"}
    assert record["state"] == "VERIFIED", record["reasons"]


def test_killing_a_replica_loses_no_request_that_had_not_started(fleet: Fleet) -> None:
    c = fleet.natives["native-c"]
    member = fleet.driver.upstream("native-c").members[0]

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=300) as client:
            async def one(i: int) -> httpx.Response:
                return await client.post(f"{fleet.url}/v1/completions", json={
                    "prompt": tokens(BLOCK), "max_tokens": 24, "ignore_eos": True},
                    headers={"Authorization": f"Bearer {KEYS['acme']}"})

            tasks = [asyncio.create_task(one(i)) for i in range(8)]
            for _ in range(400):
                if member.in_flight:
                    break
                await asyncio.sleep(0.01)
            assert member.in_flight, "no request reached native-c"
            os.killpg(c.pid, signal.SIGKILL)  # mid-run, with requests on it
            return await asyncio.gather(*tasks)

    answers = fleet.thread.run(burst())
    assert [r.status_code for r in answers] == [200] * 8, [r.text for r in answers]
    assert member.failovers >= 1 and not fleet.driver.upstream("native-c").up
    assert member.failures >= member.failovers and member.last_failure
    labels = (("rank", "0"), ("upstream", "native-c"))
    assert metric_samples(fleet)[("fak_routing_failures_total", labels)] == member.failures


def test_a_restarted_replica_gets_traffic_only_after_its_reprobe(fleet: Fleet) -> None:
    old = fleet.natives["native-c"]
    old.process.wait(10)
    upstream = fleet.driver.upstream("native-c")
    probes = upstream.driver.probes
    fleet.natives["native-c"] = start_native_server(replace(old.config, ports=old.ports))
    wait(lambda: upstream.up, 120)
    assert upstream.driver.probes > probes
    assert upstream.probed_at is not None and upstream.probed_at >= upstream.down_since
    routed_before = upstream.members[0].decisions
    for _ in range(8):
        assert fleet.post("beta", "completions", {"prompt": tokens(BLOCK),
                                                  "max_tokens": 1}).status_code == 200
    assert upstream.members[0].decisions > routed_before
    assert upstream.members[0].last_routed_at > upstream.probed_at


def test_a_cut_kv_stream_makes_the_fleet_quarantine_unverified(fleet: Fleet) -> None:
    rank1 = fleet.driver.upstream("native-b").members[1]
    fleet.thread.run(fleet.relays[1].cut())
    wait(lambda: rank1.sync_state() is SyncState.STALE, 30)
    record = quarantine(fleet)
    states = member_states(record)
    assert states["native-b/1"] == "unverified" and record["state"] == "UNVERIFIED"
    assert any(r.startswith("member=native-b/1:removal=kv_seq_gap") for r in record["reasons"])
