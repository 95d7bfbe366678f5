"""The tenant-facing routes: generation, models, health, readiness.

A generation request, in order: authenticate (headers only) → a place in the admission
queue (429 at once when full — before a byte of the body is read) → the whole body within
its size and time limits → the pipeline (governor.pipeline) → an engine slot → relay. The
queue place is given back on every path out. The metrics wait until the answer is out: at
one request in a while that code runs with cold caches, and on the way to the engine or the
client it is latency. (What the audit must record is noted before the request is served: a
log that cannot take it refuses the request.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from aiohttp import web

from governor.errors import GovernorError, unauthenticated
from governor.http.common import GOVERNOR_KEY, read_body
from governor.http.relay import Relay, relay_once, relay_stream
from governor.request_ids import RequestIds
from policies.salts import find_client_salt_headers
from schemas.engine import OFF_LOOP_BYTES
from schemas.openai import Route


def generation_handler(route: Route) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    request_ids = RequestIds()  # built with the app: in each worker process, after it starts

    async def handle(request: web.Request) -> web.StreamResponse:
        gov = request.app[GOVERNOR_KEY]
        tenant = gov.auth.tenant_for(request.headers.get("Authorization"))
        if tenant is None:
            raise unauthenticated()
        ticket = gov.reserve(tenant)
        relay: Relay | None = None
        try:
            server = gov.config.server
            raw = await read_body(request, server.max_body_bytes, server.body_timeout_s)
            request_id = request_ids.next()
            if find_client_salt_headers(request.headers.keys()):  # audited before it is served
                gov.metrics.client_salt_headers.labels(tenant.id).inc()
                gov.audit_counters.note(tenant.id, "client_header_dropped")
            if len(raw) < OFF_LOOP_BYTES:
                prepared = gov.prepare_raw(tenant, route, raw, request_id)
            else:  # parsing a large body must not stall every other request
                prepared = await asyncio.to_thread(gov.prepare_raw, tenant, route, raw,
                                                   request_id)
            waited = await gov.admit(ticket)
            relay = Relay(gov, tenant.id, route,
                          gov.metrics.for_tenant(tenant.id, tenant.tenant_class), waited)
            if prepared.request.stream:
                return await relay_stream(request, relay, prepared.request,
                                          prepared.wants_usage)
            return await relay_once(request, relay, prepared.request)
        except GovernorError as err:
            gov.metrics.rejections.labels(tenant.id, err.reason).inc()
            raise
        finally:
            gov.release(ticket, relay.tokens if relay is not None else 0)

    return handle


async def handle_models(request: web.Request) -> web.Response:
    gov = request.app[GOVERNOR_KEY]
    if gov.auth.tenant_for(request.headers.get("Authorization")) is None:
        raise unauthenticated()
    return web.json_response(await gov.driver.models())


async def handle_health(request: web.Request) -> web.Response:
    """Liveness: the governor answers, and whether the engine is alive (503 when not)."""
    gov = request.app[GOVERNOR_KEY]
    alive = await gov.driver.alive()
    return web.json_response({"status": "ok" if alive else "engine_down",
                              "engine_alive": alive}, status=200 if alive else 503)


async def handle_ready(request: web.Request) -> web.Response:
    gov = request.app[GOVERNOR_KEY]
    reasons = []
    if gov.draining:
        reasons.append("draining")
    if not await gov.driver.ready():
        reasons.append("engine_not_ready")
    problem = gov.audit_problem()
    if problem is not None:
        reasons.append(f"audit: {problem}")
    body: dict[str, object] = {"ready": not reasons}
    if reasons:
        body["reasons"] = reasons
    return web.json_response(body, status=503 if reasons else 200)
