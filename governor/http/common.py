"""What every governor route shares: the app key, error answers, body reads, the admin guard.

A body is read whole, up to `max_body_bytes` (413 past it, checked on Content-Length before
a byte is read and on the bytes as they come) and within `body_timeout_s` (408 past it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from governor.errors import GovernorError, bad_request, request_timeout, too_large, unauthenticated
from governor.state import Governor
from schemas.engine import APIError
from schemas.openai import RequestInvalid, load_json

GOVERNOR_KEY = web.AppKey("governor", Governor)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(err: APIError) -> web.Response:
    headers = err.headers if isinstance(err, GovernorError) else None
    return web.json_response(err.to_json(), status=err.status, headers=headers)


async def read_body(request: web.Request, limit: int, timeout_s: float) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise too_large(limit)
    if request.content.is_eof():  # all of it came with the head: no wait, no timer
        body = request.content.read_nowait()
        if len(body) > limit:
            raise too_large(limit)
        return body
    parts: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            while chunk := await request.content.readany():
                size += len(chunk)
                if size > limit:
                    raise too_large(limit)
                parts.append(chunk)
    except TimeoutError:
        raise request_timeout(f"the request body did not arrive within {timeout_s:g} s") \
            from None
    return b"".join(parts)


async def read_json(request: web.Request, limit: int, timeout_s: float) -> Any:
    """The body as JSON values (schemas.openai.load_json's rules), or a GovernorError."""
    raw = await read_body(request, limit, timeout_s)
    try:
        return load_json(raw)
    except RequestInvalid as exc:
        raise bad_request(exc.message, exc.param) from None


def admin_only(handler: Handler) -> Handler:
    async def guarded(request: web.Request) -> web.StreamResponse:
        gov = request.app[GOVERNOR_KEY]
        if not gov.auth.is_admin(request.headers.get("Authorization")):
            raise unauthenticated("admin token")
        return await handler(request)

    return guarded
