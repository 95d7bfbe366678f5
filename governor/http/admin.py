"""Admin routes behind the admin token: capabilities, tenants, rotation."""

from __future__ import annotations

import json
from dataclasses import asdict

from aiohttp import web

from governor.errors import not_found
from governor.http.common import GOVERNOR_KEY, admin_only
from schemas.validate import document


async def handle_capabilities(request: web.Request) -> web.Response:
    caps = request.app[GOVERNOR_KEY].driver.capabilities
    return web.json_response(json.loads(json.dumps(asdict(caps), default=str)))


async def handle_tenants(request: web.Request) -> web.Response:
    return web.json_response({"data": request.app[GOVERNOR_KEY].tenant_views()})


async def handle_rotate(request: web.Request) -> web.Response:
    gov = request.app[GOVERNOR_KEY]
    tenant_id = request.match_info["tenant_id"]
    if gov.config.tenant(tenant_id) is None:
        raise not_found(f"unknown tenant {tenant_id!r}", "tenant_id")
    return web.json_response(document(await gov.rotate(tenant_id, actor="admin-api")))


def add_admin_routes(app: web.Application) -> None:
    app.router.add_get("/admin/v1/capabilities", admin_only(handle_capabilities))
    app.router.add_get("/admin/v1/tenants", admin_only(handle_tenants))
    app.router.add_post("/admin/v1/tenants/{tenant_id}/rotate", admin_only(handle_rotate))
