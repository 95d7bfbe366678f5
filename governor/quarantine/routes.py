"""Admin routes of the quarantine service, behind the admin token (docs/design.md §5).

- `POST /admin/v1/quarantine` — body `{tenant, span: {text | messages | token_ids}, start?,
  reason, require_exact?}`; answers 200 with the record whatever its state (VERIFIED,
  UNVERIFIED, FAILED, REFUSED), 400 for a bad body, 404 for an unknown tenant, 503 when the
  audit log cannot be written.
- `GET /admin/v1/quarantine/{id}` — a record kept in memory (404 once forgotten; the audit
  log keeps every one).

A started quarantine runs to its audit record even if the admin client disconnects: the
handler waits on a shielded task, so cancelling the request does not cancel the flush.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from governor.errors import bad_request, not_found
from governor.http.common import GOVERNOR_KEY, admin_only, error_response, read_json
from governor.quarantine.executors import QuarantineConfig
from governor.quarantine.service import (
    QuarantineRecord,
    QuarantineRequest,
    QuarantineRequestError,
    QuarantineService,
    UnknownTenantError,
)

QUARANTINE_KEY = web.AppKey("quarantine", QuarantineService)
log = logging.getLogger("fak.quarantine")


def add_quarantine_routes(app: web.Application,
                          config: QuarantineConfig | None = None) -> QuarantineService:
    """Create the service over the app's governor and register both routes. A second call
    (routes already registered by `build_app`) returns the registered service, with `config`
    applied when one is given."""
    if QUARANTINE_KEY in app:
        service = app[QUARANTINE_KEY]
        if config is not None:
            service.config = config
        return service
    service = QuarantineService(app[GOVERNOR_KEY], config)
    app[QUARANTINE_KEY] = service
    app.router.add_post("/admin/v1/quarantine", admin_only(handle_quarantine))
    app.router.add_get("/admin/v1/quarantine/{quarantine_id}", admin_only(handle_show))
    return service


async def handle_quarantine(request: web.Request) -> web.Response:
    gov, service = request.app[GOVERNOR_KEY], request.app[QUARANTINE_KEY]
    try:
        server = gov.config.server
        quarantine = QuarantineRequest.from_json(
            await read_json(request, server.max_body_bytes, server.body_timeout_s))
        task = asyncio.ensure_future(service.quarantine(quarantine))
        task.add_done_callback(_log_unretrieved)
        record = await asyncio.shield(task)
    except QuarantineRequestError as exc:
        return error_response(bad_request(str(exc), exc.param))
    except UnknownTenantError as exc:
        return error_response(not_found(f"unknown tenant {exc.args[0]!r}", "tenant"))
    return web.json_response(record.to_json())


async def handle_show(request: web.Request) -> web.Response:
    service = request.app[QUARANTINE_KEY]
    quarantine_id = request.match_info["quarantine_id"]
    record = await service.lookup(quarantine_id)
    if record is None:
        return error_response(not_found(
            f"no quarantine {quarantine_id!r} in memory (the audit log has every one)",
            "quarantine_id"))
    return web.json_response(record)


def _log_unretrieved(task: asyncio.Future[QuarantineRecord]) -> None:
    """Retrieve the outcome even when the client left (else asyncio warns) and log a
    failure that is not the client's own bad request."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None and not isinstance(exc, QuarantineRequestError | UnknownTenantError):
        log.warning("quarantine ended without a record: %r", exc)
