"""adapters/vllm against both engines behind vLLM's surfaces — the session's real vLLM 0.32.0
CPU server and `fak engine serve` — all three surfaces, one test for both."""

from __future__ import annotations

import asyncio
import random
import string
import uuid

import pytest

from adapters.vllm.capabilities import VLLMDeclarations
from adapters.vllm.dev_control import DevControlCall, DevControlConfig, ResetOutcome, VLLMDevControl
from adapters.vllm.http_driver import VLLMDriver, VLLMHTTPConfig
from adapters.vllm.kv_subscriber import KVEventSubscriber, KVSubscriberConfig, SyncState
from schemas.engine import EngineRequest
from schemas.kv_events import AllBlocksCleared

from .native_server import NativeServer
from .vllm_server import VllmServer

EngineServer = VllmServer | NativeServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def letters(count: int) -> str:
    rng = random.Random(uuid.uuid4().int)
    return " ".join(rng.choice(string.ascii_lowercase) for _ in range(count))


def completion(server: EngineServer, prompt: str, salt: str) -> EngineRequest:
    body = {"model": server.model, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    return EngineRequest.of(uuid.uuid4().hex, "completions", body, "t", salt)


async def wait_until(predicate, timeout_s: float = 15.0) -> bool:
    for _ in range(int(timeout_s / 0.1)):
        if predicate():
            return True
        await asyncio.sleep(0.1)
    return predicate()


async def test_driver_subscriber_metrics_and_reset(engine_server: EngineServer) -> None:
    kv = KVEventSubscriber(
        KVSubscriberConfig(
            endpoint=engine_server.kv_endpoint,
            mode=engine_server.kv_endpoint_mode,
            replay_endpoint=engine_server.replay_endpoint,
            topic=engine_server.kv_topic,
        )
    )
    audit: list[DevControlCall] = []
    reset = VLLMDevControl(DevControlConfig(engine_server.base_url, enabled=True), audit.append)
    declared = VLLMDeclarations(
        priority_scheduling=True,
        dev_mode_reset=True,
        prompt_tokens_details=True,
        kv_probe_timeout_s=15.0,
    )
    driver = VLLMDriver(VLLMHTTPConfig(engine_server.base_url), declared, kv=kv, reset_route=reset)
    await kv.start()
    try:
        await driver.start()
        caps = driver.capabilities
        assert (caps.model_id, caps.block_size) == (engine_server.model, engine_server.block_size)
        assert caps.kv_events and caps.kv_replay and caps.prefix_reset and not caps.exact_span_evict
        # SEC-16 on the real server: hash, salt validation and both cache controls probed
        assert caps.prefix_caching_hash_algo == "sha256_cbor"
        assert caps.num_blocks == engine_server.num_blocks
        assert kv.index().capacity == engine_server.num_blocks
        if isinstance(engine_server, VllmServer):
            assert caps.engine_version == "0.32.0"
        assert {"cache_salt", "cached_tokens_in_usage", "num_blocks"} <= set(caps.probed)
        assert any(n.startswith("cache_salt: the invalid salt 'a/b' was refused (400")
                   for n in caps.notes), caps.notes
        assert any("a fresh salt 0" in n for n in caps.notes), caps.notes

        prompt, salt_a, salt_b = (
            letters(200),
            f"fak1-a-{uuid.uuid4().hex}",
            f"fak1-b-{uuid.uuid4().hex}",
        )
        usages = []
        for salt in (salt_a, salt_a, salt_b):
            (chunk,) = [c async for c in driver.generate(completion(engine_server, prompt, salt))]
            usages.append(chunk.usage)
        assert usages[0].cached_tokens == 0 and usages[1].cached_tokens > 0
        assert usages[2].cached_tokens == 0  # another tenant's salt shares nothing

        assert await wait_until(lambda: len(kv.index().resident(salt_a)) >= 2)
        assert kv.index().resident(salt_a).isdisjoint(kv.index().resident(salt_b))
        kv.index().check_integrity()
        assert kv.state() is SyncState.SYNCED

        chat = {
            "model": engine_server.model,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "stream_options": {"include_usage": True},
        }
        chunks = [
            c
            async for c in driver.generate(
                EngineRequest.of("chat-1", "chat", {**chat, "stream": True}, "t", salt_a,
                                 priority=1)
            )
        ]
        assert chunks[0].data["choices"][0]["delta"].get("role") == "assistant"
        assert chunks[-1].done and any(c.usage and c.data["choices"] == [] for c in chunks)

        mark = kv.watermark()
        result = await reset.reset_prefix_cache()
        assert (
            result.outcome is ResetOutcome.SUCCEEDED and audit[-1].outcome is ResetOutcome.SUCCEEDED
        )
        (after,) = [c async for c in driver.generate(completion(engine_server, prompt, salt_a))]
        assert after.usage.cached_tokens == 0
        assert await wait_until(
            lambda: kv.watermark().seq is not None and kv.watermark().seq > (mark.seq or -1)
        )
        evidence = kv.evidence_since(mark)
        assert evidence.gap_free
        assert any(isinstance(e, AllBlocksCleared) for b in evidence.batches for e in b.events)

        metrics = await driver.serving_metrics()
        assert metrics["prefix_cache_queries"] > 0 and metrics["prefix_cache_hit_ratio"] is not None
    finally:
        await driver.close()
        await kv.close()
