"""governor.http.relay on a real aiohttp server: a client that leaves once it has `[DONE]`,
before the end of the chunked body reaches it, is a finished stream (its close met a
closing transport and escaped as an unhandled error, a traceback per request, seen under
concurrency-64 load against the real vLLM); a client that leaves mid-stream, when a write
meets the closing transport before aiohttp cancels the handler, is a client disconnect, not
an unhandled error (seen in the hostile suite riding an engine)."""

from __future__ import annotations

import asyncio
from collections.abc import Sized

from aiohttp import web
from aiohttp.test_utils import TestServer

from governor.http.relay import DONE, Relay, SSEStream, relay_stream
from governor.metrics import GovernorMetrics, TenantMeters
from schemas.engine import EngineRequest, StreamChunk


async def post_until_answered(app: web.Application, answered: Sized) -> bytes:
    """POST to `app` on a real server, read until the server closes, then wait (up to 1 s)
    for the handler to record its outcome in `answered`; the bytes the client got."""
    async with TestServer(app) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        head = await reader.read()
        writer.close()
        for _ in range(100):
            if answered:
                break
            await asyncio.sleep(0.01)
    return head


async def test_closing_a_stream_whose_client_left_does_not_raise() -> None:
    outcomes: list[str] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        stream = SSEStream(request)
        await stream.send(DONE)
        assert request.transport is not None
        request.transport.close()  # the client is gone before the body's end is written
        try:
            response = await stream.close()
        except Exception as exc:  # what the middleware would log as unhandled
            outcomes.append(type(exc).__name__)
            raise
        outcomes.append("closed")
        return response

    app = web.Application()
    app.router.add_post("/", handle)
    head = await post_until_answered(app, outcomes)
    assert b"[DONE]" in head and outcomes == ["closed"]


class LeavingClientEngine:
    """Stands in for the governor and its driver: streams three chunks and, after the first,
    closes the client's transport, as a client that leaves between two writes does."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.config = type("Config", (), {"server": type("Server", (), {"keepalive_s": 5.0})})
        self.driver = self
        self.aborted = False

    async def generate(self, _request: EngineRequest):  # type: ignore[no-untyped-def]
        try:
            for n in range(3):
                yield StreamChunk({"choices": [{"text": str(n)}]}, raw=f'{{"n":{n}}}')
                assert self.request.transport is not None
                self.request.transport.close()
        finally:
            self.aborted = True


async def test_a_client_that_leaves_mid_stream_is_a_disconnect_not_an_error() -> None:
    seen: list[tuple[str | None, bool]] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        engine = LeavingClientEngine(request)
        relay = Relay(engine, "t", "completions",  # type: ignore[arg-type]
                      TenantMeters(GovernorMetrics(), "t", "standard"), 0.0)
        response = await relay_stream(request, relay, None, False)  # type: ignore[arg-type]
        seen.append((relay.outcome, engine.aborted))
        return response

    app = web.Application(handler_args={"handler_cancellation": False})
    app.router.add_post("/", handle)
    head = await post_until_answered(app, seen)
    assert b'{"n":0}' in head and b'{"n":2}' not in head
    assert seen == [("client_disconnect", True)]
