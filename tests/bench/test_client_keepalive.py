"""The bench client's connection pool against an engine that closes idle connections: a
connection left idle as long as an engine's idle timeout is never reused (its close would
cross the block's first requests: "Server disconnected"), one in use is."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from governor.bench.client import KEEPALIVE_S, open_session, stream_completion
from governor.bench.workloads import PlannedRequest
from tests.governor.server_thread import free_port

pytestmark = pytest.mark.slow
# The engine closes a connection idle this long, and here the close crosses the next request
# on it: the request arrives on a connection the engine has just given up (uvicorn: 5 s).
ENGINE_IDLE_CLOSE_S = KEEPALIVE_S + 0.2
EVENTS = (b'data: {"choices":[{"index":0,"text":"x"}]}\n\n'
          b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1}}\n\n'
          b"data: [DONE]\n\n")


class Engine:
    """Counts the connections requests came on; a request on a connection idle past
    `ENGINE_IDLE_CLOSE_S` finds it closed, with no answer."""

    def __init__(self) -> None:
        self.answered_at: dict[object, float] = {}
        self.dropped = 0

    async def complete(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        connection, now = request.transport, time.monotonic()
        if now - self.answered_at.get(connection, now) >= ENGINE_IDLE_CLOSE_S:
            self.dropped += 1
            assert connection is not None
            connection.close()
            return web.Response()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write_eof(EVENTS)
        self.answered_at[connection] = time.monotonic()
        return response


@pytest.fixture
async def engine() -> AsyncIterator[tuple[Engine, str]]:
    state, app = Engine(), web.Application()
    app.router.add_post("/v1/completions", state.complete)
    runner = web.AppRunner(app, keepalive_timeout=3600)  # the engine's close is modelled above
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield state, f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def test_an_idle_connection_is_dropped_before_the_engine_closes_it(
        engine: tuple[Engine, str]) -> None:
    state, url = engine
    request = PlannedRequest("hi", (1,), 1)
    session = open_session(1, 10)
    try:
        results = [await stream_completion(session, url, "fake", request, {})]
        await asyncio.sleep(0.2)
        results.append(await stream_completion(session, url, "fake", request, {}))
        assert len(state.answered_at) == 1  # kept alive while in use
        await asyncio.sleep(ENGINE_IDLE_CLOSE_S + 0.1)
        results.append(await stream_completion(session, url, "fake", request, {}))
    finally:
        await session.close()
    assert [r.error for r in results] == ["", "", ""] and all(r.success for r in results)
    assert state.dropped == 0 and len(state.answered_at) == 2
