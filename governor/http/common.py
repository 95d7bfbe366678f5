"""What every governor route shares: the app key, error answers, body reads, the admin guard."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from governor.http.validation import bad_request
from governor.state import Governor
from schemas.engine import EngineError

GOVERNOR_KEY = web.AppKey("governor", Governor)


def error_response(err: EngineError, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(err.to_json(), status=err.status, headers=headers)


def _err(status: int, message: str, type_: str, param: str | None = None) -> web.Response:
    return error_response(EngineError(status, message, type=type_, param=param))


async def read_json(request: web.Request, limit: int) -> Any:
    if request.content_length is not None and request.content_length > limit:
        raise EngineError(413, f"request body above {limit} bytes", type="invalid_request_error")
    raw = await request.content.read(limit + 1)
    if len(raw) > limit:
        raise EngineError(413, f"request body above {limit} bytes", type="invalid_request_error")
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}", None) from None


def admin_only(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
               ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def guarded(request: web.Request) -> web.StreamResponse:
        gov = request.app[GOVERNOR_KEY]
        if not gov.auth.is_admin(request.headers.get("Authorization")):
            return _err(401, "Invalid or missing admin token.", "authentication_error")
        return await handler(request)

    return guarded


