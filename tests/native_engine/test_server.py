"""`fak engine serve` on loopback with the real embedded model: the OpenAI HTTP surface,
`/metrics`, the dev-mode reset, and KV events rebuilt by the adapter's subscriber into
exactly the radix cache's resident set."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import socket
import string
from collections.abc import AsyncIterator

import httpx
import pytest

from adapters.vllm.kv_decode import fold_hash
from adapters.vllm.kv_subscriber import KVEventSubscriber, KVSubscriberConfig, SyncState
from adapters.vllm.metrics import serving_metrics, snapshot_from_text
from native_engine.serve.kv_config import KVEventsConfig
from native_engine.serve.server import RunningServer, ServerConfig, start_server
from schemas.kv_events import BlockRemoved
from tests.native_engine.kv_views import resident_block_hashes

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def letters(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(string.ascii_lowercase) for _ in range(n))


async def started(**over: object) -> RunningServer:
    kv_port, replay_port = free_port(), free_port()
    kv = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{kv_port}",
                        replay_endpoint=f"tcp://127.0.0.1:{replay_port}", topic="kv")
    # float32: greedy text must not hang on bf16 rounding, which differs between a whole
    # prefill and a chunk after a cached prefix (their GEMMs have other row counts); on an
    # AVX512-BF16 machine the bf16 default answered " m a m" cold and " m e n" warm.
    base = dict(port=0, block_size=16, num_blocks=64, max_model_len=512,
                enable_prompt_tokens_details=True, scheduling_policy="priority",
                dev_mode=True, kv_events=kv, attention_backend="torch", device="cpu",
                dtype="float32")
    return await start_server(ServerConfig(**{**base, **over}))


@pytest.fixture
async def server() -> AsyncIterator[RunningServer]:
    running = await started()
    yield running
    await running.close()


async def sse(client: httpx.AsyncClient, path: str, body: dict) -> list[dict | str]:
    events: list[dict | str] = []
    async with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def test_openai_surface_metrics_and_reset(server: RunningServer) -> None:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as c:
        prompt = letters(60, 1)
        body = {"model": "smollm2", "prompt": prompt, "max_tokens": 3, "temperature": 0,
                "cache_salt": "tenant-a", "logprobs": 2}
        first, second = [(await c.post("/v1/completions", json=body)).json() for _ in range(2)]
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 48
        assert first["choices"][0]["text"] == second["choices"][0]["text"]  # greedy, warm
        lp = first["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == 3 and all(len(t) == 2 for t in lp["top_logprobs"])
        other = (await c.post("/v1/completions", json={**body, "cache_salt": "tenant-b"})).json()
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

        long = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                "priority": -3}
        r = (await c.post("/v1/completions", json=long)).json()
        assert r["usage"]["completion_tokens"] == 12 and r["choices"][0]["finish_reason"] == \
            "length"
        stop = r["choices"][0]["text"].strip().split(" ")[1]
        r = (await c.post("/v1/completions", json={**long, "stop": [stop]})).json()
        assert r["choices"][0]["finish_reason"] == "stop" and stop not in r["choices"][0]["text"]
        assert r["choices"][0]["stop_reason"] == stop

        chat = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4,
                "stream": True, "stream_options": {"include_usage": True}, "temperature": 0}
        events = await sse(c, "/v1/chat/completions", chat)
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert events[-1] == "[DONE]" and events[-2]["choices"] == []
        assert events[-2]["usage"]["completion_tokens"] == 4
        assert events[-3]["choices"][0]["finish_reason"] == "length"

        r = await c.post("/v1/completions", json={"prompt": "x", "model": "nope"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
        r = await c.post("/v1/chat/completions", content=b"{oops",
                         headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "body.1"
        models = (await c.get("/v1/models")).json()["data"][0]
        assert (models["id"], models["max_model_len"], models["parent"]) == ("smollm2", 512, None)
        assert (await c.get("/health")).status_code == 200
        assert isinstance((await c.get("/version")).json()["version"], str)

        # 40 tokens keep it running for over a second even at 38 tok/s; the reset below is
        # one local request
        running = asyncio.create_task(c.post("/v1/completions", json={**long,
                                                                       "max_tokens": 40}))
        while (await server.engine.stats()).num_running == 0:
            await asyncio.sleep(0.05)
        assert (await c.post("/reset_prefix_cache")).json() == {"success": False}
        assert (await running).status_code == 200
        assert (await c.post("/reset_prefix_cache")).json() == {"success": True}
        again = (await c.post("/v1/completions", json=body)).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

        text = (await c.get("/metrics")).text
        compute = server.llm_engine.runner.compute  # type: ignore[attr-defined]
        assert compute.dtype == "float32"
        info = next(line for line in text.splitlines()
                    if line.startswith("fak:engine_compute_info{"))
        assert f'dtype="{compute.dtype}"' in info and 'attention="torch_fast"' in info
        snapshot = snapshot_from_text(text, "smollm2")
        record = serving_metrics(snapshot)
        missing = [f.name for f in dataclasses.fields(record) if getattr(record, f.name) is None]
        assert not missing, missing
        assert snapshot.block_size == 16 and record.prefix_cache_hits >= 48
        assert record.generation_tokens == (await server.engine.stats()).generation_tokens


async def test_kv_events_rebuild_the_resident_set(server: RunningServer) -> None:
    kv_config = server.config.kv_events
    kv = KVEventSubscriber(KVSubscriberConfig(
        endpoint=kv_config.endpoint, replay_endpoint=kv_config.replay_endpoint, topic="kv"))
    await kv.start()
    try:
        assert await kv.wait_connected(10)
        start = kv.watermark()
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as c:

            async def complete(prompt: str, salt: str | None, n: int = 2) -> dict:
                body = {"prompt": prompt, "max_tokens": n, "temperature": 0,
                        **({"cache_salt": salt} if salt else {})}
                r = await c.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()

            shared = letters(100, 2)
            for salt in ("t-a", "t-a", "t-b", None):
                await complete(shared, salt, n=20)  # decode fills blocks past the prompt
            await complete(shared + " " + letters(30, 3), "t-a")  # a branch off t-a's path
            # 64 blocks of 16 tokens: these distinct prompts force evictions.
            await asyncio.gather(*(complete(letters(180, 10 + i), "t-c") for i in range(4)))
            await compare(kv, server)
            removed = sum(isinstance(e, BlockRemoved)
                          for b in kv.evidence_since(start).batches for e in b.events)
            assert removed > 0, "the script did not force any eviction"
            assert (await c.post("/reset_prefix_cache")).json() == {"success": True}
            await complete(shared, "t-a")
            await compare(kv, server)
    finally:
        await kv.close()


async def compare(kv: KVEventSubscriber, server: RunningServer) -> None:
    """The shadow index equals the engine's own view, per namespace, once caught up."""
    last = server.publisher.next_seq - 1  # type: ignore[attr-defined]
    assert await kv.wait_for_seq(last, timeout_s=10)
    view = await server.engine.call(resident_block_hashes)
    index = kv.index()
    index.check_integrity()
    assert kv.state() is SyncState.SYNCED
    want = {ns: {fold_hash(h) for h in hashes} for ns, hashes in view.items()}
    assert index.all_blocks() == frozenset().union(*want.values())
    for ns, hashes in want.items():
        assert index.resident(ns) == hashes, ns
    assert not index.uncertain()


async def test_kv_tiers_behind_the_served_surfaces(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`--kv-offloading-size` / `--kv-disk-dir` / `--kv-disk-size`: an evicted prefix comes
    back from a lower tier, /metrics counts it per medium, KV events name the media."""
    block = 737_280  # SmolLM2-135M, fp32, 16 tokens
    running = await started(num_blocks=24, max_model_len=256,
                            kv_offloading_size=6 * block / (1 << 30),
                            kv_disk_dir=str(tmp_path), kv_disk_size=0.05)
    kv_config = running.config.kv_events
    kv = KVEventSubscriber(KVSubscriberConfig(
        endpoint=kv_config.endpoint, replay_endpoint=kv_config.replay_endpoint, topic="kv"))
    await kv.start()
    try:
        assert await kv.wait_connected(10)
        async with httpx.AsyncClient(base_url=running.base_url, timeout=300) as c:
            async def cached(prompt: str, salt: str) -> int:
                r = await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2,
                                                          "temperature": 0, "cache_salt": salt})
                assert r.status_code == 200, r.text
                return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

            kept = letters(70, 40)
            assert await cached(kept, "t-a") == 0
            for i in range(4):  # push it out of the 24-block pool
                await cached(letters(120, 41 + i), "t-c")
            assert await cached(kept, "t-a") >= 48
            assert await cached(kept, "t-b") == 0
            text = (await c.get("/metrics")).text
        stats = {s.medium: s for s in (await running.engine.stats()).tiers}
        assert stats["CPU"].promotions + stats["DISK"].promotions > 0
        for medium, s in stats.items():
            assert (f'fak_kv_tier_promotions_total{{engine="0",medium="{medium}",'
                    f'model_name="smollm2"}} {float(s.promotions)}') in text
        last = running.publisher.next_seq - 1  # type: ignore[attr-defined]
        assert await kv.wait_for_seq(last, timeout_s=10)
        index = kv.index()
        media = {m for h in index.all_blocks() for m in index.get(h).media}  # type: ignore[union-attr]
        assert {"GPU", "CPU"} <= media
        index.check_integrity()
    finally:
        await kv.close()
        await running.close()
