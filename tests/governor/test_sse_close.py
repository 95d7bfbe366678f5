"""governor.http.relay.SSEStream on a real aiohttp server: a client that leaves once it has
`[DONE]`, before the end of the chunked body reaches it, is a finished stream. Its close
met a closing transport and escaped as an unhandled error (a traceback per request, seen
under concurrency-64 load against the real vLLM)."""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.test_utils import TestServer

from governor.http.relay import DONE, SSEStream


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
    async with TestServer(app) as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        head = await reader.read()
        writer.close()
        for _ in range(100):
            if outcomes:
                break
            await asyncio.sleep(0.01)
    assert b"[DONE]" in head and outcomes == ["closed"]
