"""The control plane's connections over a real loopback server: a pooled connection is
reused while fresh and dropped once idle for `keepalive_s`, so a call never goes out on a
connection the engine is about to close at its own idle timeout (uvicorn's 5 s under vLLM,
the metrics scrape's period); the driver gives the control plane its own `keepalive_s`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from aiohttp import web

from adapters.vllm.control_plane import ControlPlane, ControlPlaneConfig
from adapters.vllm.http_driver import VLLMDriver, VLLMHTTPConfig
from adapters.vllm.urls import EngineURLs
from schemas.engine import EngineCapabilities
from tests.adapters.vllm_imitation import serve_app

METRICS = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n"


@contextlib.asynccontextmanager
async def engine() -> AsyncIterator[tuple[str, list[int]]]:
    """A server that keeps idle connections 30 s and notes each request's client port."""
    ports: list[int] = []

    async def version(request: web.Request) -> web.Response:
        ports.append(request.transport.get_extra_info("peername")[1])  # type: ignore[union-attr]
        return web.json_response({"version": "0.32.0"})

    async def metrics(request: web.Request) -> web.Response:
        ports.append(request.transport.get_extra_info("peername")[1])  # type: ignore[union-attr]
        return web.Response(text=METRICS)

    app = web.Application()
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    runner, url = await serve_app(app)
    try:
        yield url, ports
    finally:
        await runner.cleanup()


async def test_an_idle_connection_is_dropped_after_keepalive_s() -> None:
    async with engine() as (url, ports):
        control = ControlPlane(EngineURLs(url), {}, ControlPlaneConfig(keepalive_s=0.3))
        try:
            for pause in (0.05, 0.05, 0.6):
                assert await control.version() == "0.32.0"
                await asyncio.sleep(pause)
            assert await control.version() == "0.32.0"
        finally:
            await control.close()
    assert ports[0] == ports[1] == ports[2] != ports[3]  # reused while fresh, then a new one


async def test_the_driver_gives_the_control_plane_its_keepalive() -> None:
    caps = EngineCapabilities(engine_kind="vllm", model_id="m", cache_salt=True)
    async with engine() as (url, ports):
        driver = VLLMDriver(VLLMHTTPConfig(url, keepalive_s=0.3), capabilities=caps)
        await driver.start()
        try:
            await driver.serving_metrics()
            await driver.serving_metrics()
            await asyncio.sleep(0.6)
            await driver.serving_metrics()
        finally:
            await driver.close()
    assert ports[0] == ports[1] != ports[2]
