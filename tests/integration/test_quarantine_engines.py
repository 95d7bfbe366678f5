"""One quarantine code path over the engines a governor rides: `fak engine serve` with its
cache-control route (exact, VERIFIED with the KV events' `BlockRemoved` set) and the real
vLLM 0.32 (no such route: exact is refused, a dev-mode flush is the degraded plan). The
in-process native engine runs the same executors in tests/governor/test_quarantine_native.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from adapters.vllm.capabilities import CapabilityRefusedError, VLLMDeclarations
from adapters.vllm.dev_control import DevControlConfig, VLLMDevControl
from adapters.vllm.fak_control import FakCacheControlClient, FakControlConfig
from adapters.vllm.http_driver import VLLMDriver, VLLMHTTPConfig
from adapters.vllm.kv_subscriber import KVEventSubscriber, KVSubscriberConfig
from governor.auth import sha256_hex
from governor.config import parse_config
from governor.quarantine.executors import QuarantineConfig
from governor.quarantine.service import QuarantineRequest, QuarantineService, SpanInput
from governor.serve import build_governor
from governor.state import Governor
from tests.prompts import FreshPrompts

from .native_server import (
    NativeServer,
    NativeServerConfig,
    NativeServerError,
    start_native_server,
    stop_native_server,
)
from .vllm_server import VllmServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]
CONFIG = QuarantineConfig(drain_timeout_s=2.0, kv_timeout_s=15.0, probe_timeout_s=120.0)


@pytest.fixture(scope="module")
def quarantine_server() -> Iterator[NativeServer]:
    """A `fak engine serve` of this module's own: the session's shared server may still be
    finishing another test's abandoned requests, and pool pressure from them would evict the
    copies these tests assert stay."""
    try:
        server = start_native_server(NativeServerConfig(num_blocks=256))
    except NativeServerError as exc:
        pytest.fail(f"native server unavailable: {exc}", pytrace=False)
    try:
        yield server
    finally:
        stop_native_server(server)


letters = FreshPrompts().words


def driver_for(server: NativeServer | VllmServer, token: str | None) -> VLLMDriver:
    kv = KVEventSubscriber(KVSubscriberConfig(
        endpoint=server.kv_endpoint, mode=server.kv_endpoint_mode,  # type: ignore[arg-type]
        replay_endpoint=server.replay_endpoint, topic=server.kv_topic))
    dev = VLLMDevControl(DevControlConfig(server.base_url, enabled=True), lambda call: None)
    fak = None if token is None else FakCacheControlClient(
        FakControlConfig(server.base_url, token), lambda call: None)
    return VLLMDriver(VLLMHTTPConfig(server.base_url),
                      VLLMDeclarations(dev_mode_reset=True, prompt_tokens_details=True,
                                       priority_scheduling=True, kv_probe_timeout_s=15.0),
                      kv=kv, reset_route=dev, fak_control=fak)


@contextlib.asynccontextmanager
async def governed(driver: VLLMDriver, base_url: str, tmp_path: Path
                   ) -> AsyncIterator[tuple[Governor, QuarantineService]]:
    await driver.start()
    config = parse_config({
        "server": {"data_dir": str(tmp_path), "admin_token_sha256": sha256_hex("admin")},
        "engine": {"kind": "vllm", "base_url": base_url},
        "tenants": [{"id": t, "api_key_sha256": [sha256_hex(f"key-{t}")]}
                    for t in ("acme", "beta")]})
    gov = build_governor(config, driver, create_key=True)
    service = QuarantineService(gov, CONFIG)
    try:
        yield gov, service
        service.check_integrity()
    finally:
        await driver.close()
        gov.audit.close()


async def cached(gov: Governor, tenant: str, prompt: str) -> int:
    usage = await gov.driver.cache_control.probe(tenant, gov.salt_for(tenant), "completions",
                                                 {"prompt": prompt}, 120.0)
    assert usage is not None and usage.cached_tokens is not None
    return usage.cached_tokens


async def test_exact_span_over_http_is_verified_by_block_removed(
        quarantine_server: NativeServer, tmp_path: Path) -> None:
    server = quarantine_server
    driver = driver_for(server, server.cache_control_token)
    async with governed(driver, server.base_url, tmp_path) as (gov, service):
        assert gov.driver.capabilities.exact_span_evict is True
        # Small spans in a pool of the module's own: nothing here is evicted by pressure.
        poisoned, other = letters(100), letters(100)
        for tenant, prompt in (("acme", other), ("acme", poisoned), ("beta", poisoned)):
            await cached(gov, tenant, prompt)
        record = await service.quarantine(QuarantineRequest(
            tenant="acme", span=SpanInput(text=poisoned), reason="ticket-http-1",
            require_exact=True))
        assert (record.plan, record.degraded, record.state.value) == ("exact", False,
                                                                      "VERIFIED")
        assert record.evidence.kv_events == "block_removed_set_ok"
        assert record.evidence.probe_control_cached_tokens > 0
        assert record.evidence.probe_after_cached_tokens == 0
        assert any(r.startswith("kv_blocks_removed=") and r != "kv_blocks_removed=0"
                   for r in record.reasons)
        assert record.span.length > 0
        assert await cached(gov, "beta", poisoned) > 0  # the other tenant's copy stays
        assert await cached(gov, "acme", other) > 0  # the tenant's other path stays
        assert await cached(gov, "acme", poisoned) == 0


async def test_mid_span_cut_over_http_keeps_the_prefix(quarantine_server: NativeServer,
                                                       tmp_path: Path) -> None:
    server = quarantine_server
    driver = driver_for(server, server.cache_control_token)
    async with governed(driver, server.base_url, tmp_path) as (gov, service):
        prompt = letters(200)
        start = 2 * server.block_size
        record = await service.quarantine(QuarantineRequest(
            tenant="acme", span=SpanInput(text=prompt), start=start, reason="ticket-http-2",
            require_exact=True))
        assert (record.plan, record.state.value) == ("exact", "VERIFIED"), record.reasons
        assert record.evidence.probe_after_cached_tokens <= start
        assert await cached(gov, "acme", prompt) == start


async def test_the_route_needs_its_token(native_vllm_server: NativeServer,
                                         tmp_path: Path) -> None:
    url = native_vllm_server.base_url + "/fak/v1/cache/evict_span"
    body = {"namespace": "x", "span": {"text": "hello"}, "start": 0}
    async with httpx.AsyncClient() as client:
        for headers in ({}, {"Authorization": "Bearer wrong-token-wrong-token"}):
            r = await client.post(url, json=body, headers=headers)
            assert r.status_code == 401 and set(r.json()["error"]) == {
                "message", "type", "param", "code"}
    driver = driver_for(native_vllm_server, "wrong-token-wrong-token")
    with pytest.raises(CapabilityRefusedError, match="cache-control"):
        await driver.start()
    await driver.close()


async def test_real_vllm_has_no_exact_span(vllm_server: VllmServer, tmp_path: Path) -> None:
    """No token configured: nothing probed, exact refused, the flush is the degraded plan.
    A token configured against a real vLLM is refused at start-up (the route is not there)."""
    async with governed(driver_for(vllm_server, None), vllm_server.base_url,
                        tmp_path) as (gov, service):
        assert gov.driver.capabilities.exact_span_evict is False
        record = await service.quarantine(QuarantineRequest(
            tenant="acme", span=SpanInput(text=letters(40)), reason="ticket-http-3",
            require_exact=True))
        assert record.state.value == "REFUSED"
    driver = driver_for(vllm_server, "some-token-some-token")
    with pytest.raises(CapabilityRefusedError):
        await driver.start()
    await driver.close()
