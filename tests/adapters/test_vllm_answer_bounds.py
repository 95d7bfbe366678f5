"""What one upstream answer may make the governor hold (`max_answer_bytes`), over a real
loopback server: a whole answer (with or without a length, compressed or not), an error
body, one SSE event, and every control-plane answer; past the bound the request is a 502
and the connection is closed, and the next request is served."""

from __future__ import annotations

import contextlib
import gzip
from collections.abc import AsyncIterator

import httpx
import pytest
from aiohttp import web

from adapters.vllm.control_plane import (
    CONTROL_ANSWER_BYTES,
    AnswerTooLarge,
    ControlPlane,
    ControlPlaneConfig,
)
from adapters.vllm.dev_control import DevControlCall, DevControlConfig, VLLMDevControl
from adapters.vllm.http_driver import VLLMDriver, VLLMHTTPConfig
from adapters.vllm.metrics import MetricsScrapeError, scrape
from adapters.vllm.urls import EngineURLs
from schemas.engine import EngineCapabilities, EngineError, EngineRequest
from tests.adapters.vllm_imitation import Imitation, serve_app, start_imitation

CAPS = EngineCapabilities(engine_kind="vllm", model_id="smollm2", cache_salt=True)
LIMIT = 4096
GOOD = b'{"id":"c","object":"text_completion","choices":[{"index":0,"text":"hi"}]}'
EVENT = b'data: {"id":"c","choices":[{"index":0,"text":"a"}]}\n\n'


async def huge_chunked(request: web.Request, head: bytes, headers: dict[str, str],
                       status: int = 200) -> web.StreamResponse:
    """`head`, then 1 KiB pieces with no length and no end in sight (1 MiB at most)."""
    response = web.StreamResponse(status=status, headers=headers)
    await response.prepare(request)
    await response.write(head)
    with contextlib.suppress(ConnectionError):
        for _ in range(1024):
            await response.write(b"x" * 1024)
    return response


async def generation(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    shape = body["prompt"]
    if shape == "good":
        return web.Response(body=GOOD, content_type="application/json")
    if shape == "long-with-length":
        return web.Response(body=b'{"x":"' + b"x" * 2 * LIMIT + b'"}',
                            content_type="application/json")
    if shape == "long-gzip":
        return web.Response(body=gzip.compress(b'{"x":"' + b"x" * 1_000_000 + b'"}'),
                            headers={"Content-Type": "application/json",
                                     "Content-Encoding": "gzip"})
    if shape == "long-chunked":
        return await huge_chunked(request, b'{"x":"', {"Content-Type": "application/json"})
    if shape == "long-error":
        return await huge_chunked(request, b'{"error":"', {"Content-Type": "application/json"},
                                  status=500)
    # streams: a few good events, then one that never ends
    good = EVENT * (0 if shape == "endless-event" else 3)
    return await huge_chunked(request, good + b'data: {"x":"', {"Content-Type":
                                                                  "text/event-stream"})


@contextlib.asynccontextmanager
async def upstream() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/v1/completions", generation)
    runner, url = await serve_app(app)
    try:
        yield url
    finally:
        await runner.cleanup()


def request(shape: str, stream: bool = False) -> EngineRequest:
    return EngineRequest.of("r", "completions", {"prompt": shape, "stream": stream}, "t", "s")


@pytest.mark.parametrize("shape", ["long-with-length", "long-chunked", "long-gzip",
                                   "long-error"])
async def test_a_whole_answer_past_the_bound_is_a_502(shape: str) -> None:
    async with upstream() as url:
        driver = VLLMDriver(VLLMHTTPConfig(url, max_answer_bytes=LIMIT), capabilities=CAPS)
        await driver.start()
        try:
            with pytest.raises(EngineError) as refused:
                [c async for c in driver.generate(request(shape))]
            assert refused.value.status == 502
            assert f"larger than {LIMIT} bytes" in refused.value.message
            (good,) = [c async for c in driver.generate(request("good"))]
            assert good.data["choices"][0]["text"] == "hi"
        finally:
            await driver.close()


@pytest.mark.parametrize(("shape", "before"), [("endless-event", 0), ("late-endless", 3)])
async def test_an_sse_event_past_the_bound_is_a_502_after_the_events_before_it(
        shape: str, before: int) -> None:
    async with upstream() as url:
        driver = VLLMDriver(VLLMHTTPConfig(url, max_answer_bytes=LIMIT), capabilities=CAPS)
        await driver.start()
        chunks = []
        try:
            with pytest.raises(EngineError) as refused:
                async for chunk in driver.generate(request(shape, stream=True)):
                    chunks.append(chunk)
            assert refused.value.status == 502 and "SSE event is larger" in refused.value.message
            assert len(chunks) == before
        finally:
            await driver.close()


async def test_control_plane_answers_are_bounded() -> None:
    """Health, models, version and metrics answers past the bound: unhealthy, a 502, no
    version, a failed scrape; within it, as before."""
    big = b"# HELP x y\n" + b"x 1\n" * 3000  # ~12 KB, over a 4 KiB bound
    routes = web.RouteTableDef()

    @routes.get("/health")
    async def health(_: web.Request) -> web.Response:
        return web.Response(body=big)

    @routes.get("/v1/models")
    async def models(_: web.Request) -> web.Response:
        return web.Response(body=b'{"data":[' + b" " * 2 * LIMIT + b"]}",
                            content_type="application/json")

    @routes.get("/version")
    async def version(_: web.Request) -> web.Response:
        return web.Response(body=gzip.compress(b'{"version":"' + b"9" * 2 * LIMIT + b'"}'),
                            headers={"Content-Encoding": "gzip"})

    @routes.get("/metrics")
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=big)

    app = web.Application()
    app.add_routes(routes)
    runner, url = await serve_app(app)
    control = ControlPlane(EngineURLs(url), {}, ControlPlaneConfig(max_answer_bytes=LIMIT))
    try:
        assert await control.healthy() is False
        with pytest.raises(AnswerTooLarge, match="/v1/models"):
            await control.models()
        assert await control.version() is None
        with pytest.raises(MetricsScrapeError, match="AnswerTooLarge"):
            await scrape(control.client, EngineURLs(url), limit=LIMIT)
        assert (await scrape(control.client, EngineURLs(url), limit=len(big))) is not None
    finally:
        await control.close()
        await runner.cleanup()


async def test_a_dev_reset_answered_past_the_bound_is_a_502_on_the_audit_trail() -> None:
    async def reset(_: web.Request) -> web.Response:
        return web.Response(body=b"x" * (CONTROL_ANSWER_BYTES + 1))

    app = web.Application()
    app.router.add_post("/reset_prefix_cache", reset)
    runner, url = await serve_app(app)
    calls: list[DevControlCall] = []
    try:
        with pytest.raises(EngineError) as refused:
            await VLLMDevControl(DevControlConfig(url, enabled=True), calls.append
                                 ).reset_prefix_cache()
    finally:
        await runner.cleanup()
    assert refused.value.status == 502 and "AnswerTooLarge" in refused.value.message
    assert len(calls) == 1 and "AnswerTooLarge" in str(calls[0])


async def test_the_recorded_vllm_answers_fit_the_default_bounds() -> None:
    runner, url = await start_imitation(Imitation())
    driver = VLLMDriver(VLLMHTTPConfig(url), capabilities=CAPS)
    await driver.start()
    try:
        assert (await driver.models())["data"][0]["id"] == "smollm2"
        assert (await driver.serving_metrics())["prefix_cache_queries"] is not None
        assert await driver.ready()
    finally:
        await driver.close()
        await runner.cleanup()


def test_the_bounds_are_validated() -> None:
    with pytest.raises(ValueError):
        VLLMHTTPConfig("http://h", max_answer_bytes=0)
    with pytest.raises(ValueError):
        ControlPlaneConfig(max_answer_bytes=0)
    assert httpx.HTTPError in AnswerTooLarge.__mro__
