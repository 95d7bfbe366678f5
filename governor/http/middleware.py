"""Every failure leaves as OpenAI-shaped JSON with the right status; the process stays up.

aiohttp's own HTTP errors (404, 405, 413 from `client_max_size`) keep their status; an
APIError answers itself; anything else is a bug: 500 with a generic message (never the
exception text), logged with its traceback at most once per `LOG_EVERY_S` per kind.
"""

from __future__ import annotations

import logging
import time

from aiohttp import web

from governor.errors import GovernorError, internal_error
from governor.http.common import Handler, error_response
from schemas.engine import APIError

log = logging.getLogger("fak.http")
LOG_EVERY_S = 10.0


class RateLimitedLog:
    """Logs one traceback per exception type and route per interval; counts the rest."""

    def __init__(self, every_s: float = LOG_EVERY_S) -> None:
        self.every_s = every_s
        self._last: dict[tuple[str, str], float] = {}
        self.suppressed = 0

    def exception(self, route: str, exc: BaseException) -> None:
        key = (route, type(exc).__name__)
        now = time.monotonic()
        if now - self._last.get(key, -self.every_s) < self.every_s:
            self.suppressed += 1
            return
        if len(self._last) > 1024:  # kinds are bounded by code paths; stay bounded anyway
            self._last.clear()
        self._last[key] = now
        log.error("unhandled error on %s (%d similar suppressed)", route, self.suppressed,
                  exc_info=exc)


def json_errors(errors_log: RateLimitedLog) -> web.middleware:  # type: ignore[valid-type]
    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            kind = "invalid_request_error" if exc.status < 500 else "server_error"
            return error_response(GovernorError(exc.status, exc.reason, kind,
                                                reason=f"http_{exc.status}"))
        except APIError as err:
            return error_response(err)
        except Exception as exc:
            route = request.match_info.route.resource.canonical \
                if request.match_info.route.resource else "unmatched"
            errors_log.exception(route, exc)
            return error_response(internal_error())

    return middleware
