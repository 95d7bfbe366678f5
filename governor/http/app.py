"""The governor's HTTP apps: the tenant-facing one and the private metrics one
(docs/design.md §5)."""

from __future__ import annotations

from aiohttp import web

from governor.http.admin import add_admin_routes
from governor.http.common import GOVERNOR_KEY
from governor.http.listener import ListenerGuard, head_tracking
from governor.http.metrics_routes import handle_private_metrics, handle_tenant_port_metrics
from governor.http.middleware import RateLimitedLog, json_errors
from governor.http.routes import generation_handler, handle_health, handle_models, handle_ready
from governor.quarantine.routes import add_quarantine_routes
from governor.state import Governor


def build_app(gov: Governor, guard: ListenerGuard | None = None) -> web.Application:
    middlewares = [json_errors(RateLimitedLog())]
    if guard is not None:
        middlewares.insert(0, head_tracking(guard))
    # aiohttp's own limit is a backstop above ours (the handlers answer 413 themselves).
    app = web.Application(middlewares=middlewares,
                          client_max_size=gov.config.server.max_body_bytes + 1)
    app[GOVERNOR_KEY] = gov
    app.router.add_post("/v1/chat/completions", generation_handler("chat"))
    app.router.add_post("/v1/completions", generation_handler("completions"))
    app.router.add_get("/v1/models", handle_models)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/ready", handle_ready)
    app.router.add_get("/metrics", handle_tenant_port_metrics)
    add_admin_routes(app)
    add_quarantine_routes(app)
    return app


def build_metrics_app(gov: Governor) -> web.Application:
    app = web.Application(middlewares=[json_errors(RateLimitedLog())])
    app[GOVERNOR_KEY] = gov
    app.router.add_get("/metrics", handle_private_metrics)
    return app
