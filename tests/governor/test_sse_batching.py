"""Events an engine sends together leave together: the vLLM driver marks each chunk that has
another one at hand from the same read (`StreamChunk.more`), and the relay writes such a run
in one write, `[DONE]` with the body's end; an error after held events still sends them
first. On real aiohttp servers and a real client session."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from adapters.vllm.http_driver import _relay_sse
from governor.http.relay import Relay, relay_stream
from governor.metrics import GovernorMetrics, TenantMeters
from schemas.engine import APIError, EngineRequest, StreamChunk


def event(n: int) -> bytes:
    return b'data: {"choices":[{"text":"%d"}]}\n\n' % n


async def test_the_driver_marks_chunks_read_together() -> None:
    async def handle(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(event(0) + event(1) + event(2))  # one write: one read
        await asyncio.sleep(0.1)
        await response.write(event(3))
        await asyncio.sleep(0.1)
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/", handle)
    async with TestServer(app) as server, aiohttp.ClientSession() as session, \
            session.post(server.make_url("/")) as response:
        deadline = asyncio.get_running_loop().time() + 10
        chunks = [c async for c in _relay_sse(response, deadline, deadline, 1 << 20)]
    assert [(c.raw, c.more) for c in chunks] == [
        ('{"choices":[{"text":"0"}]}', True), ('{"choices":[{"text":"1"}]}', True),
        ('{"choices":[{"text":"2"}]}', False), ('{"choices":[{"text":"3"}]}', False),
        (None, False)]
    assert chunks[-1].done


class Engine:
    """Stands in for the governor and its driver: yields `chunks`, then raises `error`."""

    def __init__(self, chunks: list[StreamChunk], error: APIError | None = None) -> None:
        self.chunks, self.error = chunks, error
        self.config = type("Config", (), {"server": type("Server", (), {"keepalive_s": 5.0})})
        self.driver = self

    async def generate(self, _request: EngineRequest) -> AsyncIterator[StreamChunk]:
        for chunk in self.chunks:
            yield chunk
        if self.error is not None:
            raise self.error


def text(n: int, more: bool) -> StreamChunk:
    return StreamChunk({"choices": [{"text": str(n)}]}, raw=f'{{"n":{n}}}', more=more)


async def relayed(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> tuple[bytes, list[bytes]]:
    """The bytes a raw client got from `relay_stream` over `engine`, and each write the
    relay made (aiohttp's own, recorded as they pass)."""
    writes: list[bytes] = []
    write, write_eof = web.StreamResponse.write, web.StreamResponse.write_eof

    async def recorded_write(self: web.StreamResponse, data: bytes) -> None:
        writes.append(bytes(data))
        await write(self, data)

    async def recorded_eof(self: web.StreamResponse, data: bytes = b"") -> None:
        writes.append(b"EOF:" + bytes(data))
        await write_eof(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", recorded_write)
    monkeypatch.setattr(web.StreamResponse, "write_eof", recorded_eof)
    outcomes: list[str | None] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        relay = Relay(engine, "t", "completions",  # type: ignore[arg-type]
                      TenantMeters(GovernorMetrics(), "t", "standard"), 0.0)
        response = await relay_stream(request, relay, None, False)  # type: ignore[arg-type]
        outcomes.append(relay.outcome)
        return response

    app = web.Application()
    app.router.add_post("/", handle)
    async with TestServer(app) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n"
                     b"Connection: close\r\n\r\n")
        got = await asyncio.wait_for(reader.read(), 10)
        writer.close()
    assert outcomes == ["ok" if engine.error is None else "engine_error"]
    return got, writes


async def test_events_given_together_leave_in_one_write(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    engine = Engine([text(0, True), text(1, True), text(2, False), text(3, True),
                     StreamChunk(None, done=True)])
    got, writes = await relayed(engine, monkeypatch)
    assert writes == [b'data: {"n":0}\n\ndata: {"n":1}\n\ndata: {"n":2}\n\n',
                      b'EOF:data: {"n":3}\n\ndata: [DONE]\n\n', b"EOF:"]
    assert got.endswith(b'data: {"n":3}\n\ndata: [DONE]\n\n\r\n0\r\n\r\n')


async def test_an_error_after_held_events_sends_them_first(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """Held events are not dropped for a status error: the stream opens with them, then the
    error leaves as its last event."""
    engine = Engine([text(0, True), text(1, True)], APIError(502, "the engine broke"))
    got, _ = await relayed(engine, monkeypatch)
    assert got.startswith(b"HTTP/1.1 200")
    body = got.split(b"\r\n\r\n", 1)[1]
    assert body.index(b'{"n":0}') < body.index(b'{"n":1}') < body.index(b"the engine broke") \
        < body.index(b"[DONE]")
