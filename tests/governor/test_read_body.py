"""governor.http.common.read_body on a real aiohttp server: the size limit holds on both of
its paths — a body that came whole with its head (read at once) and one still arriving —
with and without Content-Length."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from governor.errors import GovernorError
from governor.http.common import read_body

LIMIT = 100


async def handle(request: web.Request) -> web.Response:
    try:
        body = await read_body(request, LIMIT, timeout_s=5)
    except GovernorError as err:
        return web.Response(status=err.status)
    return web.Response(text=f"{len(body)} {request.content.is_eof()}")


def chunked(body: bytes) -> bytes:
    return (b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n"
            b"Connection: close\r\n\r\n" + f"{len(body):x}\r\n".encode() + body
            + b"\r\n0\r\n\r\n")


def sized(body: bytes) -> bytes:
    return (b"POST / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)


async def answer(port: int, request: bytes, split_at: int | None) -> bytes:
    """Send the request in one write, or in two with a pause (the body still arriving)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    parts = [request] if split_at is None else [request[:split_at], request[split_at:]]
    for i, part in enumerate(parts):
        if i:
            await asyncio.sleep(0.05)
        writer.write(part)
        await writer.drain()
    data = await reader.read()
    writer.close()
    return data


@pytest.mark.parametrize("frame", [chunked, sized])
@pytest.mark.parametrize("size", [LIMIT, LIMIT + 1])
@pytest.mark.parametrize("whole", [True, False])
async def test_the_limit_holds_on_both_paths(frame: object, size: int, whole: bool) -> None:
    app = web.Application()
    app.router.add_post("/", handle)
    async with TestServer(app) as server:
        request = frame(b"x" * size)  # type: ignore[operator]
        got = await answer(server.port, request, None if whole else len(request) - 3)
    status = int(got.split(b" ", 2)[1])
    if size > LIMIT:
        assert status == 413, got
    else:
        assert status == 200 and got.endswith(f"{size} True".encode()), got
