"""A real `fak serve` relaying thousands of answers and streams leaves next to no cyclic
garbage (issue 19): what a request allocates is freed by reference counting, so the
collector's young collections, each a pause of every request in flight, stay rare.

Read from the governor's own `/metrics` (`python_gc_objects_collected_total`), riding
bench/instant_upstream.py. With one small cycle per request (the salt scan's recursive
closure, before) 3,000 requests left ~30,000 objects for the collector.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.http_client import HTTP
from tests.processes import serving

from .fak_serve_process import REPO_ROOT, FakServe, start_fak_serve, stop_fak_serve, write_config
from .server_thread import free_port

pytestmark = pytest.mark.slow
KEY = "sk-garbage-" + "0" * 16
REQUESTS, STREAMS, CONCURRENCY = 3000, 300, 16
GARBAGE_ALLOWED = 2000  # start-up stragglers and the engine-metrics refresher's own


@pytest.fixture
def governed(tmp_path: Path) -> Iterator[FakServe]:
    port = free_port()
    upstream = f"http://127.0.0.1:{port}"
    with serving([str(REPO_ROOT / "bench" / "instant_upstream.py"), "--port", str(port),
                  "--chunks", "8"], upstream + "/health"):
        config = tmp_path / "fak.toml"
        write_config(config, {"max_engine_concurrency": 256},
                     {"kind": "vllm", "base_url": upstream, "model": "smollm2"},
                     {KEY: {"id": "bench", "class": "interactive", "max_concurrency": 256}},
                     "admin-" + "1" * 24)
        config.write_text(config.read_text() + "\n[engine.declare]\n"
                          "prompt_tokens_details = true\n")
        served = start_fak_serve(config, tmp_path / "data")
        try:
            yield served
        finally:
            stop_fak_serve(served)


def collected(served: FakServe) -> float:
    text = HTTP.get(served.metrics_url + "/metrics", timeout=10).text
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples if s.name == "python_gc_objects_collected_total")


async def load(url: str) -> list[int]:
    body = {"model": "smollm2", "prompt": "Say hello.", "max_tokens": 1}
    headers = {"Authorization": f"Bearer {KEY}"}
    statuses: list[int] = []
    async with aiohttp.ClientSession(headers=headers) as session:
        async def worker(n: int, stream: bool) -> None:
            for _ in range(n):
                async with session.post(url, json={**body, "stream": stream}) as r:
                    await r.read()
                    statuses.append(r.status)
        await asyncio.gather(*(worker(REQUESTS // CONCURRENCY, False)
                               for _ in range(CONCURRENCY)))
        await asyncio.gather(*(worker(STREAMS // CONCURRENCY, True)
                               for _ in range(CONCURRENCY)))
    return statuses


def test_thousands_of_requests_leave_next_to_nothing_to_collect(governed: FakServe) -> None:
    url = governed.url + "/v1/completions"
    asyncio.run(load(url))  # warm: lazy imports and first-use caches
    before = collected(governed)
    statuses = asyncio.run(load(url))
    assert statuses == [200] * len(statuses)
    assert collected(governed) - before < GARBAGE_ALLOWED
