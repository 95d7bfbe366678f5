"""Admin routes behind the admin token: capabilities, upstreams, tenants, rotation."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from aiohttp import web

from adapters.driver import Fleet
from governor.errors import not_found
from governor.http.common import GOVERNOR_KEY, admin_only
from schemas.validate import document


async def handle_capabilities(request: web.Request) -> web.Response:
    caps = request.app[GOVERNOR_KEY].driver.capabilities
    return web.json_response(json.loads(json.dumps(asdict(caps), default=str)))


async def handle_upstreams(request: web.Request) -> web.Response:
    """Each upstream and rank: health, capabilities, KV-index sync state, load and routing
    counts. The single-upstream form is one upstream; the native engine has none."""
    gov = request.app[GOVERNOR_KEY]
    driver = gov.driver
    if isinstance(driver, Fleet):
        views, routing = driver.upstream_views(), driver.routing_view()
    elif driver.capabilities.engine_kind == "vllm":
        views, routing = [single_upstream_view(driver, await driver.ready())], None
    else:
        views, routing = [], None
    return web.json_response(json.loads(json.dumps({"data": views, "routing": routing},
                                                   default=str)))


def single_upstream_view(driver: Any, up: bool) -> dict[str, Any]:
    kv = driver.kv
    ranks = [{"rank": r, "sync_state": kv.state(r).value, "index_blocks": len(kv.index(r))}
             for r in kv.ranks()] if kv is not None else [{"rank": 0, "sync_state": None}]
    return {"name": "default", "base_url": driver.config.base_url, "up": up,
            "refusal": driver.refusal, "data_parallel_size": len(ranks),
            "probes": driver.probes, "capabilities": asdict(driver.capabilities),
            "ranks": ranks}


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
    app.router.add_get("/admin/v1/upstreams", admin_only(handle_upstreams))
    app.router.add_get("/admin/v1/tenants", admin_only(handle_tenants))
    app.router.add_post("/admin/v1/tenants/{tenant_id}/rotate", admin_only(handle_rotate))
