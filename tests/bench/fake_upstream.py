"""A vLLM-shaped upstream with a known latency distribution, for testing the statistics.

A real aiohttp server on loopback, no model: TTFT and every inter-chunk gap are sleeps
drawn from a seeded log-normal (median × `slowdown` × the drift factor), so the truth a
test checks against is known. `drift_per_s` makes the server slower as time passes,
`1 + drift_per_s × (now − origin)`; two servers given the same origin and rate drift like one
machine getting slower. The prefix cache is vLLM's, simplified: full blocks of
`block_size` tokens (by the same tokenizer the bench uses), reported as
`usage.prompt_tokens_details.cached_tokens`. Surfaces: /v1/completions (streaming), /v1/models,
/version, /health and a dev-mode /server_info saying the engine is eager. With `cpu_tail_s`
every core is kept busy that long each time the server falls idle, as vLLM CPU's worker
spins after its last answer.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field

from aiohttp import web

from governor.bench.workloads import BenchTokenizer

from .cpu_load import reap, spin_every_core

MODEL = "fake"


@dataclass
class FakeUpstreamConfig:
    ttft_median_s: float = 0.02
    itl_median_s: float = 0.002
    sigma: float = 0.15
    slowdown: float = 1.0
    drift_per_s: float = 0.0
    origin: float = field(default_factory=time.perf_counter)
    block_size: int = 16
    seed: int = 0
    cpu_tail_s: float = 0.0


class FakeUpstream:
    def __init__(self, config: FakeUpstreamConfig, tokenizer: BenchTokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.rng = random.Random(config.seed)
        self.cached: set[tuple[int, ...]] = set()
        self.requests = 0
        self.in_flight = 0
        self.tails: list[subprocess.Popen[bytes]] = []

    def _draw(self, median: float) -> float:
        c = self.config
        factor = c.slowdown * (1.0 + c.drift_per_s * (time.perf_counter() - c.origin))
        return median * factor * math.exp(self.rng.gauss(0.0, c.sigma))

    def _lookup_and_insert(self, ids: list[int]) -> int:
        """Cached tokens: the longest run of full blocks seen before; then cache these."""
        bs = self.config.block_size
        hit = 0
        for end in range(bs, len(ids) + 1, bs):
            if tuple(ids[:end]) not in self.cached:
                break
            hit = end
        for end in range(bs, len(ids) + 1, bs):
            self.cached.add(tuple(ids[:end]))
        return hit

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.in_flight += 1
        try:
            return await self._complete(request)
        finally:
            self.in_flight -= 1
            if not self.in_flight and self.config.cpu_tail_s > 0:
                self.tails += spin_every_core(self.config.cpu_tail_s)

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests += 1
        ids = self.tokenizer.encode(body["prompt"])
        cached = self._lookup_and_insert(ids)
        n = int(body["max_tokens"])
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await asyncio.sleep(self._draw(self.config.ttft_median_s))
        for i in range(n):
            if i:
                await asyncio.sleep(self._draw(self.config.itl_median_s))
            chunk = {"id": "cmpl-fake", "object": "text_completion", "model": MODEL,
                     "choices": [{"index": 0, "text": "x",
                                  "finish_reason": "length" if i == n - 1 else None}]}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        usage = {"prompt_tokens": len(ids), "completion_tokens": n,
                 "total_tokens": len(ids) + n,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        await response.write(b"data: " + json.dumps({"id": "cmpl-fake", "choices": [],
                                                     "usage": usage}).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": MODEL, "object": "model", "owned_by": "vllm", "root": MODEL}]})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "0.32.0"})

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"vllm_config": {"model_config": {"enforce_eager": True},
                                                  "compilation_config": {"mode": 0}}})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/version", self.version)
        app.router.add_get("/server_info", self.server_info)
        app.router.add_get("/health", self.health)
        return app


@asynccontextmanager
async def serving(*upstreams: FakeUpstream) -> AsyncIterator[list[str]]:
    """Serve each upstream on its own loopback port in this event loop; yields base URLs."""
    runners, urls = [], []
    try:
        for upstream in upstreams:
            runner = web.AppRunner(upstream.app())
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = runner.addresses[0][1]
            runners.append(runner)
            urls.append(f"http://127.0.0.1:{port}")
        yield urls
    finally:
        for runner in runners:
            await runner.cleanup()
        for upstream in upstreams:
            reap(upstream.tails)


@contextmanager
def serving_in_thread(*upstreams: FakeUpstream) -> Iterator[list[str]]:
    """The same servers on an event loop in a background thread, for code that runs its
    own loop (the `fak` command line)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    entered = serving(*upstreams)
    try:
        urls = asyncio.run_coroutine_threadsafe(entered.__aenter__(), loop).result(30)
        try:
            yield urls
        finally:
            asyncio.run_coroutine_threadsafe(entered.__aexit__(None, None, None),
                                             loop).result(30)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
