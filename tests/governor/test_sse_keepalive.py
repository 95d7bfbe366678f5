"""governor.http.relay's keep-alive comments while a stream waits for the engine's first
chunk, on a real aiohttp server: the comments open the stream and stop at the first chunk,
which follows them; a client that leaves meanwhile cancels the engine's read where it waits,
and nothing is written or left running after."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer

from governor.http.relay import Relay, relay_stream
from governor.metrics import GovernorMetrics, TenantMeters
from schemas.engine import EngineRequest, StreamChunk

KEEPALIVE_S = 0.05


class SlowFirstChunkEngine:
    """Stands in for the governor and its driver: one chunk after `delay_s`, then [DONE]."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.config = type("Config", (), {"server": type("Server", (),
                                                         {"keepalive_s": KEEPALIVE_S})})
        self.driver = self
        self.read_cancelled = False
        self.closed = False

    async def generate(self, _request: EngineRequest):  # type: ignore[no-untyped-def]
        try:
            await asyncio.sleep(self.delay_s)
            yield StreamChunk({"choices": [{"text": "x"}]}, raw='{"n":0}')
            yield StreamChunk(None, done=True)
        except asyncio.CancelledError:
            self.read_cancelled = True
            raise
        finally:
            self.closed = True


def relaying(engine: SlowFirstChunkEngine, outcomes: list[str | None]) -> web.Application:
    async def handle(request: web.Request) -> web.StreamResponse:
        relay = Relay(engine, "t", "completions",  # type: ignore[arg-type]
                      TenantMeters(GovernorMetrics(), "t", "standard"), 0.0)
        try:
            return await relay_stream(request, relay, None, False)  # type: ignore[arg-type]
        finally:
            outcomes.append(relay.outcome)

    app = web.Application()
    app.router.add_post("/", handle)
    return app


async def open_post(server: TestServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"POST / HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
    await writer.drain()
    return reader, writer


def unretrieved_errors(loop: asyncio.AbstractEventLoop) -> list[dict[str, Any]]:
    """What the loop would log as unhandled (a task's exception never retrieved)."""
    seen: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: seen.append(context))
    return seen


async def settled() -> None:
    """Past the time a timer left armed would write (and fail: the answer has ended), with
    a failed task collected, so that its unretrieved exception is reported."""
    await asyncio.sleep(3 * KEEPALIVE_S)
    gc.collect()


async def whole_answer(engine: SlowFirstChunkEngine, outcomes: list[str | None]) -> bytes:
    """The bytes a client reads to the end of the answer, once the server has settled."""
    async with TestServer(relaying(engine, outcomes)) as server:
        reader, writer = await open_post(server)
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        await settled()
    return answer


async def test_comments_open_the_stream_and_stop_at_the_first_chunk() -> None:
    errors = unretrieved_errors(asyncio.get_running_loop())
    engine, outcomes = SlowFirstChunkEngine(delay_s=0.3), []
    head, _, body = (await whole_answer(engine, outcomes)).partition(b"\r\n\r\n")
    assert b"200 OK" in head and b"text/event-stream" in head
    comments = body.count(b": keep-alive")  # up to 6 due; a busy loop may fire fewer
    assert 1 <= comments <= 0.3 / KEEPALIVE_S + 1, body
    assert body.rindex(b": keep-alive") < body.index(b'data: {"n":0}') < body.index(b"[DONE]")
    assert outcomes == ["ok"] and engine.closed and not engine.read_cancelled
    assert errors == []


async def test_a_first_chunk_before_the_interval_sends_no_comment() -> None:
    errors = unretrieved_errors(asyncio.get_running_loop())
    engine, outcomes = SlowFirstChunkEngine(delay_s=0.0), []
    answer = await whole_answer(engine, outcomes)
    assert b"keep-alive" not in answer and b'data: {"n":0}' in answer
    assert outcomes == ["ok"] and errors == []


async def test_a_client_gone_during_the_wait_cancels_the_engine_read() -> None:
    errors = unretrieved_errors(asyncio.get_running_loop())
    engine, outcomes = SlowFirstChunkEngine(delay_s=30.0), []
    async with TestServer(relaying(engine, outcomes), handler_cancellation=True) as server:
        reader, writer = await open_post(server)
        seen = b""
        while b"keep-alive" not in seen:
            seen += await asyncio.wait_for(reader.read(4096), 10)
        writer.close()
        for _ in range(200):
            if outcomes:
                break
            await asyncio.sleep(0.01)
        await settled()
    assert outcomes == ["client_disconnect"]
    assert engine.read_cancelled and engine.closed
    assert errors == []
