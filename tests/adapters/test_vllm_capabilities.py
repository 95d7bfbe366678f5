"""Capability probes against the 0.32.0 imitation and real ZeroMQ sockets (docs/design.md §2)."""

from __future__ import annotations

import pytest
import zmq.asyncio

from adapters.vllm.capabilities import CapabilityRefusedError, VLLMDeclarations
from adapters.vllm.dev_control import DevControlConfig, VLLMDevControl
from adapters.vllm.http_driver import VLLMDriver, VLLMHTTPConfig
from adapters.vllm.kv_subscriber import KVEventSubscriber, KVSubscriberConfig
from schemas.engine import Determinism
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
    assert [p for _, p, _, _ in state.received] == ["/v1/models", "/metrics"]


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
    probe_body = next(b for m, p, _, b in state.received if p == "/v1/completions")
    assert probe_body["cache_salt"] and probe_body["max_tokens"] == 1


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
