"""Capability probes against the 0.32.0 imitation and real ZeroMQ sockets (docs/design.md §2),
and SEC-16: upstream isolation probed, not assumed — a weak hash, salts not validated or not
honoured refuse start-up in one line, and a reconnect re-probes before traffic."""

from __future__ import annotations

import asyncio

import pytest
import zmq.asyncio

from adapters.vllm.capabilities import CapabilityRefusedError, VLLMDeclarations
from adapters.vllm.dev_control import DevControlConfig, VLLMDevControl
from adapters.vllm.http_driver import VLLMDriver, VLLMHTTPConfig
from adapters.vllm.kv_subscriber import KVEventSubscriber, KVSubscriberConfig
from adapters.vllm.upstream_errors import EngineNotReached
from schemas.engine import Determinism, EngineError, EngineRequest
from schemas.validate import validate
from tests.adapters.test_vllm_kv_subscriber import FakeVLLMSockets, free_port
from tests.adapters.vllm_imitation import Imitation, start_imitation


async def probe(state: Imitation, declared: VLLMDeclarations, kv=None, dev_enabled: bool = True):
    runner, base_url = await start_imitation(state)
    reset = VLLMDevControl(DevControlConfig(base_url, enabled=dev_enabled), lambda call: None)
    driver = VLLMDriver(VLLMHTTPConfig(base_url), declared, kv=kv, reset_route=reset)
    try:
        await driver.start()
        return driver.capabilities
    finally:
        await driver.close()
        await runner.cleanup()


async def test_plain_probe_fills_facts_and_keeps_declarable_flags_off() -> None:
    state = Imitation()
    caps = await probe(state, VLLMDeclarations())
    assert (caps.engine_kind, caps.model_id, caps.max_model_len, caps.block_size) == (
        "vllm",
        "smollm2",
        2048,
        128,
    )
    assert caps.cache_salt and not caps.exact_span_evict
    assert not (
        caps.priority_scheduling
        or caps.prefix_reset
        or caps.kv_events
        or caps.cached_tokens_in_usage
    )
    assert caps.determinism is Determinism.UNAVAILABLE
    assert [p for _, p, _, _ in state.received] == [
        "/v1/models", "/version", "/metrics", "/v1/completions"]
    assert state.received[-1][3]["cache_salt"] == "a/b"  # vLLM's salt validation, probed
    assert (caps.engine_version, caps.prefix_caching_hash_algo, caps.num_blocks) == (
        "0.32.0", "sha256_cbor", 24)
    assert {"cache_salt", "prefix_caching_hash_algo", "engine_version"} <= set(caps.probed)
    assert caps.declared == () and "cached_tokens_in_usage" not in caps.probed
    validate("engine_capabilities", caps)


async def test_declarations_confirmed_by_probes() -> None:
    state = Imitation()
    declared = VLLMDeclarations(
        priority_scheduling=True,
        dev_mode_reset=True,
        prompt_tokens_details=True,
        determinism="Batch-Invariant",
    )
    caps = await probe(state, declared)
    assert caps.priority_scheduling and caps.prefix_reset and caps.cached_tokens_in_usage
    assert caps.determinism is Determinism.BATCH_INVARIANT
    assert not caps.exact_span_evict
    assert ("GET", "/reset_prefix_cache") in {(m, p) for m, p, _, _ in state.received}
    assert ("POST", "/reset_prefix_cache") not in {(m, p) for m, p, _, _ in state.received}
    controls = [b for m, p, _, b in state.received if p == "/v1/completions"][1:]
    assert [b["max_tokens"] for b in controls] == [1, 1, 1]
    salts = [b["cache_salt"] for b in controls]
    assert salts[0] == salts[1] != salts[2]  # positive control, then a fresh salt
    assert {"prefix_reset", "cached_tokens_in_usage"} <= set(caps.probed)
    assert set(caps.declared) == {"priority_scheduling", "prefix_reset",
                                  "cached_tokens_in_usage", "determinism"}
    assert "priority_scheduling" not in caps.probed
    validate("engine_capabilities", caps)


async def test_declared_dev_mode_refused_when_route_missing() -> None:
    with pytest.raises(CapabilityRefusedError, match="reset_prefix_cache"):
        await probe(Imitation(dev_mode=False), VLLMDeclarations(dev_mode_reset=True))


async def test_declared_prompt_details_refused_when_absent() -> None:
    with pytest.raises(CapabilityRefusedError, match="enable-prompt-tokens-details"):
        await probe(Imitation(prompt_details=False), VLLMDeclarations(prompt_tokens_details=True))


async def test_unknown_served_model_refused() -> None:
    with pytest.raises(CapabilityRefusedError, match="nope"):
        await probe(Imitation(), VLLMDeclarations(served_model="nope"))


@pytest.mark.slow
async def test_kv_endpoint_probed_over_real_sockets() -> None:
    ctx = zmq.asyncio.Context()
    port = free_port()
    engine = FakeVLLMSockets(ctx, port)
    kv = KVEventSubscriber(
        KVSubscriberConfig(
            f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{engine.replay_port}"
        )
    )
    await kv.start()
    try:
        caps = await probe(Imitation(), VLLMDeclarations(kv_probe_timeout_s=5.0), kv=kv)
        assert caps.kv_events and caps.kv_replay
    finally:
        await kv.close()
        await engine.close()
        ctx.destroy(linger=0)


@pytest.mark.slow
async def test_kv_endpoint_without_publisher_refused() -> None:
    kv = KVEventSubscriber(KVSubscriberConfig(f"tcp://127.0.0.1:{free_port()}"))
    await kv.start()
    try:
        with pytest.raises(CapabilityRefusedError, match="no publisher"):
            await probe(Imitation(), VLLMDeclarations(kv_probe_timeout_s=0.3), kv=kv)
    finally:
        await kv.close()


# --- SEC-16: isolation probed, not assumed ---------------------------------------------


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor", "builtin"])
async def test_weak_prefix_hash_refused(algo: str) -> None:
    with pytest.raises(CapabilityRefusedError, match=f"hashes prefix-cache blocks with {algo}"
                       ) as refused:
        await probe(Imitation(hash_algo=algo), VLLMDeclarations())
    assert "\n" not in str(refused.value) and "sha256" in str(refused.value)


async def test_unknown_prefix_hash_refused() -> None:
    with pytest.raises(CapabilityRefusedError, match="does not export prefix_caching_hash_algo"):
        await probe(Imitation(hash_algo=None), VLLMDeclarations())


async def test_server_without_salt_validation_refused() -> None:
    with pytest.raises(CapabilityRefusedError, match="does not validate, so does not honour"):
        await probe(Imitation(validates_salts=False), VLLMDeclarations())


async def test_salts_ignored_by_the_cache_fail_the_negative_control() -> None:
    state = Imitation(honours_salts=False)
    with pytest.raises(CapabilityRefusedError, match="negative control failed"):
        await probe(state, VLLMDeclarations(prompt_tokens_details=True))
    # The same server honouring salts passes both controls.
    caps = await probe(Imitation(), VLLMDeclarations(prompt_tokens_details=True))
    assert "cache_salt: same salt repeat hit 256 cached tokens, a fresh salt 0" in caps.notes


async def test_reconnect_reprobes_before_traffic() -> None:
    """The upstream goes away and comes back on the same port as an xxhash server: no
    request reaches it until a re-probe passes, and requests meanwhile get 503."""
    state = Imitation()
    runner, base_url = await start_imitation(state)
    port = int(base_url.rsplit(":", 1)[1])
    driver = VLLMDriver(VLLMHTTPConfig(base_url, reprobe_interval_s=0.0))
    request = EngineRequest.of("r1", "completions", {"prompt": "hello there", "max_tokens": 1},
                               "t", "fak1-salt")
    try:
        await driver.start()
        assert driver.probes == 1 and [c async for c in driver.generate(request)]
        await runner.cleanup()
        with pytest.raises(EngineError) as down:
            [c async for c in driver.generate(request)]
        assert down.value.status == 502
        weak = Imitation(hash_algo="xxhash")
        runner, _ = await start_imitation(weak, port)
        with pytest.raises(EngineError, match="xxhash") as refused:
            [c async for c in driver.generate(request)]
        assert refused.value.status == 503 and not await driver.ready()
        assert isinstance(refused.value, EngineNotReached)  # held back, nothing was sent
        assert not any(p == "/v1/completions" and b.get("cache_salt") == "fak1-salt"
                       for _, p, _, b in weak.received)
        await runner.cleanup()
        runner, _ = await start_imitation(Imitation(), port)
        await asyncio.sleep(0)
        assert [c async for c in driver.generate(request)] and await driver.ready()
        assert driver.capabilities.prefix_caching_hash_algo == "sha256_cbor"
    finally:
        await driver.close()
        await runner.cleanup()
