"""`fak engine serve --data-parallel-size 2 --api-key K` on a tiny random model: one engine per
rank with vLLM's KV-event port offsets and rank stamps, the `X-data-parallel-rank` header,
per-rank metrics, and the API key on every `/v1` route (health, version, metrics open)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from adapters.vllm.kv_subscriber import KVEventSubscriber, KVSubscriberConfig, SyncState
from adapters.vllm.metrics import snapshot_from_text
from native_engine.serve.kv_config import KVEventsConfig
from native_engine.serve.server import RunningServer, ServerConfig, start_server
from tests.adapters.test_vllm_kv_subscriber import free_port
from tests.native_engine.test_server_faults import tiny_dir  # noqa: F401 - fixture

KEY = "upstream-key-0123456789"


@pytest.fixture
async def server(tiny_dir: Path) -> AsyncIterator[RunningServer]:  # noqa: F811
    kv_port, replay_port = free_port(), free_port() + 10
    running = await start_server(ServerConfig(
        port=0, block_size=4, num_blocks=64, max_model_len=256, attention_backend="torch",
        device="cpu", dtype="float32", model=str(tiny_dir), served_model_name="tiny",
        enable_prompt_tokens_details=True, dev_mode=True, api_key=KEY, data_parallel_size=2,
        kv_events=KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{kv_port}",
                                 replay_endpoint=f"tcp://*:{replay_port}", topic="kv")))
    yield running
    await running.close()


def body(prompt: list[int]) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0,
            "cache_salt": "s"}


async def test_two_ranks_with_offsets_header_metrics_and_api_key(server: RunningServer) -> None:
    kv = server.config.kv_events
    subscriber = KVEventSubscriber(KVSubscriberConfig(
        endpoint=kv.endpoint, replay_endpoint=kv.replay_endpoint, topic="kv",
        data_parallel_size=2))
    await subscriber.start()
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        assert await subscriber.wait_connected(10)  # both ranks' PUBs, on port and port + 1
        assert await subscriber.probe_replay()  # both ROUTERs, on replay port and + 1
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as c:
            assert (await c.post("/v1/completions", json=body([5] * 9))).status_code == 401
            bad = await c.post("/v1/completions", json=body([5] * 9),
                               headers={"Authorization": "Bearer nope"})
            assert bad.status_code == 401 and bad.json() == {"error": "Unauthorized"}
            assert (await c.get("/v1/models")).status_code == 401
            assert (await c.get("/health")).status_code == 200
            assert (await c.get("/version")).status_code == 200
            prompt = list(range(10, 19))  # two full blocks of 4, plus one token
            for rank in (1, 1, 0):
                r = await c.post("/v1/completions", json=body(prompt),
                                 headers={**auth, "X-data-parallel-rank": str(rank)})
                assert r.status_code == 200, r.text
            cached = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]]
            # rank 1 cached the prompt twice over; rank 0 saw it once: no hit there
            assert cached == [0]
            again = await c.post("/v1/completions", json=body(prompt),
                                 headers={**auth, "X-data-parallel-rank": "1"})
            assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 8
            for bad_rank in ("2", "-1", "x"):
                r = await c.post("/v1/completions", json=body(prompt),
                                 headers={**auth, "X-data-parallel-rank": bad_rank})
                assert r.status_code == 400 and r.json()["error"]["param"] == \
                    "X-data-parallel-rank"
            snapshot = snapshot_from_text((await c.get("/metrics")).text)
            assert sorted(c.engine for c in snapshot.cache_config) == ["0", "1"]
            assert all(c.num_gpu_blocks == 64 for c in snapshot.cache_config)
            sources = (await c.get("/kv_event_sources")).json()
            assert set(sources) == {"0", "1"}
        for rank in (0, 1):
            assert await subscriber.wait_for_seq(0, dp_rank=rank, timeout_s=10)
        await asyncio.sleep(0.2)
        assert all(subscriber.state(r) is SyncState.SYNCED for r in (0, 1))
        assert subscriber.index(1).resident("s") and subscriber.index(0).resident("s")
        assert subscriber.foreign_rank_batches == 0
    finally:
        await subscriber.close()


def test_cache_control_is_refused_with_data_parallel() -> None:
    with pytest.raises(ValueError, match="data-parallel-size"):
        ServerConfig(data_parallel_size=2, cache_control_token="t" * 16)
    with pytest.raises(ValueError, match="data_parallel_size"):
        ServerConfig(data_parallel_size=0)


def test_a_disk_tier_is_refused_with_data_parallel(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="kv-disk-dir"):
        ServerConfig(data_parallel_size=2, kv_disk_dir=str(tmp_path), kv_disk_size=1.0)
    ServerConfig(data_parallel_size=2, kv_offloading_size=0.5)  # a host tier per rank
