"""The governor's HTTP front: OpenAI routes, health, metrics and admin (docs/design.md §5)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict
from typing import Any

from aiohttp import web

from governor.admission import AdmissionRejected
from governor.audit.counters import namespace_headers
from governor.http.common import GOVERNOR_KEY, _err, admin_only, error_response, read_json
from governor.http.validation import validate_body
from governor.quarantine.routes import add_quarantine_routes
from governor.state import Governor
from schemas.engine import EngineError, EngineRequest, StreamChunk, Usage
from schemas.validate import document

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def _sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def _sse_chunk(chunk: StreamChunk) -> bytes:
    if chunk.raw is not None:
        return b"data: " + chunk.raw.encode() + b"\n\n"
    return _sse(chunk.data or {})


def _is_usage_only(chunk: StreamChunk) -> bool:
    return chunk.data is not None and chunk.data.get("choices") == [] and "usage" in chunk.data


class Relay:
    """One accepted request: its tenant, timings and accounting, as plain fields."""

    def __init__(self, gov: Governor, tenant: str, route: str) -> None:
        self.gov, self.tenant, self.route = gov, tenant, route
        self.started = time.monotonic()
        self.first_token_at: float | None = None
        self.usage: Usage | None = None

    def saw(self, chunk: StreamChunk) -> None:
        if chunk.usage is not None:
            self.usage = chunk.usage
        if self.first_token_at is None and chunk.data and chunk.data.get("choices"):
            self.first_token_at = time.monotonic()

    def finish(self, outcome: str) -> None:
        m = self.gov.metrics
        m.requests.labels(self.tenant, self.route, outcome).inc()
        m.e2e.labels(self.tenant).observe(time.monotonic() - self.started)
        if self.first_token_at is not None:
            m.ttft.labels(self.tenant).observe(self.first_token_at - self.started)
        if self.usage is not None:
            m.prompt_tokens.labels(self.tenant).inc(self.usage.prompt_tokens)
            m.completion_tokens.labels(self.tenant).inc(self.usage.completion_tokens)
            m.cached_tokens.labels(self.tenant).inc(self.usage.cached_tokens or 0)


async def _first_chunk(
    request: web.Request, chunks: AsyncIterator[StreamChunk], keepalive_s: float
) -> tuple[StreamChunk | None, web.StreamResponse | None]:
    """Wait for the engine's first chunk; past `keepalive_s` open the stream and send comments.

    Until the first chunk, an engine error can still be answered with its own status.
    """
    pending = asyncio.ensure_future(anext(chunks, None))
    response = None
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=keepalive_s)
            if done:
                return pending.result(), response
            if response is None:
                response = web.StreamResponse(headers=SSE_HEADERS)
                await response.prepare(request)
            await response.write(b": keep-alive\n\n")
    finally:
        if not pending.done():
            pending.cancel()


async def relay_stream(request: web.Request, relay: Relay, engine_request: EngineRequest,
                       client_wants_usage: bool) -> web.StreamResponse:
    gov = relay.gov
    chunks = gov.driver.generate(engine_request)
    response: web.StreamResponse | None = None
    try:
        chunk, response = await _first_chunk(request, chunks, gov.config.server.keepalive_s)
        if response is None:
            response = web.StreamResponse(headers=SSE_HEADERS)
            await response.prepare(request)
        while chunk is not None:
            relay.saw(chunk)
            if chunk.done:
                await response.write(b"data: [DONE]\n\n")
            elif client_wants_usage or not _is_usage_only(chunk):
                await response.write(_sse_chunk(chunk))
            chunk = await anext(chunks, None)
        relay.finish("ok")
    except EngineError as err:
        relay.finish("engine_error")
        if response is None:
            return error_response(err)
        await response.write(_sse(err.to_json()) + b"data: [DONE]\n\n")
    except (asyncio.CancelledError, ConnectionResetError):
        relay.finish("client_disconnect")
        raise
    finally:
        await chunks.aclose()
    await response.write_eof()
    return response


async def relay_once(relay: Relay, engine_request: EngineRequest) -> web.Response:
    chunks = relay.gov.driver.generate(engine_request)
    try:
        chunk = await anext(chunks)
    except EngineError as err:
        relay.finish("engine_error")
        return error_response(err)
    except asyncio.CancelledError:
        relay.finish("client_disconnect")
        raise
    finally:
        await chunks.aclose()
    relay.saw(chunk)
    relay.finish("ok")
    if chunk.raw is not None:
        return web.Response(text=chunk.raw, content_type="application/json")
    return web.json_response(chunk.data)


def generation_handler(route: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handle(request: web.Request) -> web.StreamResponse:
        gov = request.app[GOVERNOR_KEY]
        tenant = gov.auth.tenant_for(request.headers.get("Authorization"))
        if tenant is None:
            gov.metrics.rejections.labels("unknown", "unauthenticated").inc()
            return _err(401, "Invalid or missing API key.", "authentication_error")
        try:
            if namespace_headers(request.headers):
                gov.audit_counters.note(tenant.id, "client_header_dropped")
            body = validate_body(route, await read_json(request, gov.config.server.max_body_bytes),
                                 tenant.max_tokens)
            engine_request, wants_usage = gov.prepare(tenant, route, body,
                                                      request_id=f"fak-{uuid.uuid4().hex}")
        except EngineError as err:
            gov.metrics.rejections.labels(tenant.id, f"bad_request:{err.param}").inc()
            return error_response(err)
        try:
            waited = await gov.admit(tenant)
        except AdmissionRejected as rej:
            gov.metrics.rejections.labels(tenant.id, rej.reason).inc()
            return error_response(
                EngineError(429, f"Too many requests ({rej.reason}); retry later.",
                            type="rate_limit_error"),
                headers={"Retry-After": str(rej.retry_after_s)},
            )
        gov.metrics.admission_wait.labels(tenant.tenant_class).observe(waited)
        relay = Relay(gov, tenant.id, route)
        try:
            if engine_request.stream:
                return await relay_stream(request, relay, engine_request, wants_usage)
            return await relay_once(relay, engine_request)
        finally:
            gov.release(tenant)

    return handle


async def handle_models(request: web.Request) -> web.Response:
    gov = request.app[GOVERNOR_KEY]
    if gov.auth.tenant_for(request.headers.get("Authorization")) is None:
        return _err(401, "Invalid or missing API key.", "authentication_error")
    try:
        return web.json_response(await gov.driver.models())
    except EngineError as err:
        return error_response(err)


async def handle_health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def handle_ready(request: web.Request) -> web.Response:
    gov = request.app[GOVERNOR_KEY]
    ready = not gov.draining and await gov.driver.ready()
    return web.json_response({"ready": ready}, status=200 if ready else 503)


async def handle_metrics(request: web.Request) -> web.Response:
    gov = request.app[GOVERNOR_KEY]
    await gov.refresh_serving_metrics()
    gov.metrics.in_flight.set(gov.admission.in_flight)
    gov.metrics.queued.set(gov.admission.waiting)
    return web.Response(body=gov.metrics.render(),
                        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def handle_capabilities(request: web.Request) -> web.Response:
    caps = request.app[GOVERNOR_KEY].driver.capabilities
    return web.json_response(json.loads(json.dumps(asdict(caps), default=str)))


async def handle_tenants(request: web.Request) -> web.Response:
    return web.json_response({"data": request.app[GOVERNOR_KEY].tenant_views()})


async def handle_rotate(request: web.Request) -> web.Response:
    gov = request.app[GOVERNOR_KEY]
    tenant_id = request.match_info["tenant_id"]
    if gov.config.tenant(tenant_id) is None:
        return _err(404, f"unknown tenant {tenant_id!r}", "not_found_error", "tenant_id")
    return web.json_response(document(await gov.rotate(tenant_id, actor="admin-api")))


@web.middleware
async def json_errors(request: web.Request, handler: Callable[[web.Request],
                      Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Every failure, ours or aiohttp's, leaves as OpenAI-style JSON; the process stays up."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _err(exc.status, exc.reason, "invalid_request_error" if exc.status < 500
                    else "server_error")
    except EngineError as err:
        return error_response(err)


def build_app(gov: Governor) -> web.Application:
    app = web.Application(middlewares=[json_errors],
                          client_max_size=gov.config.server.max_body_bytes)
    app[GOVERNOR_KEY] = gov
    app.router.add_post("/v1/chat/completions", generation_handler("chat"))
    app.router.add_post("/v1/completions", generation_handler("completions"))
    app.router.add_get("/v1/models", handle_models)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/ready", handle_ready)
    app.router.add_get("/metrics", handle_metrics)
    app.router.add_get("/admin/v1/capabilities", admin_only(handle_capabilities))
    app.router.add_get("/admin/v1/tenants", admin_only(handle_tenants))
    app.router.add_post("/admin/v1/tenants/{tenant_id}/rotate", admin_only(handle_rotate))
    add_quarantine_routes(app)
    return app
