"""`/metrics`: on the private listener; on the tenant port only to the metrics token.

No tenant key ever reads them: per-tenant counters and the engine's global cache counters
would tell one tenant about another's traffic and cache hits (SEC-6). Rendering reads the
last snapshot; the engine is scraped on a timer (`ServingMetricsRefresher`), never per
request, so scrapes can neither starve generation nor multiply the load on the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging

from aiohttp import web

from governor.auth import bearer_token
from governor.errors import GovernorError
from governor.http.common import GOVERNOR_KEY
from governor.state import Governor

log = logging.getLogger("fak.metrics")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def render(gov: Governor) -> web.Response:
    gov.metrics.in_flight.set(gov.admission.in_flight)
    gov.metrics.queued.set(gov.admission.waiting)
    return web.Response(body=gov.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


async def handle_private_metrics(request: web.Request) -> web.Response:
    return render(request.app[GOVERNOR_KEY])


async def handle_tenant_port_metrics(request: web.Request) -> web.Response:
    gov = request.app[GOVERNOR_KEY]
    expected = gov.config.server.metrics_token_sha256
    if expected is None:
        raise GovernorError(404, "/metrics is served on the private metrics listener",
                            "not_found_error", reason="metrics_elsewhere")
    token = bearer_token(request.headers.get("Authorization"))
    presented = hashlib.sha256((token or "").encode("utf-8", "surrogateescape")).digest()
    if token is None or not hmac.compare_digest(presented, bytes.fromhex(expected)):
        raise GovernorError(401, "Invalid or missing metrics token.", "authentication_error",
                            reason="unauthenticated")
    return render(gov)


class ServingMetricsRefresher:
    """Scrapes the engine's serving metrics every `every_s` into the governor's metrics;
    one scrape at a time, bounded by `timeout_s`. A failure is logged once per streak."""

    def __init__(self, gov: Governor, every_s: float, timeout_s: float) -> None:
        self.gov, self.every_s, self.timeout_s = gov, every_s, timeout_s
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    async def refresh(self) -> None:
        try:
            async with asyncio.timeout(self.timeout_s):
                values = await self.gov.driver.serving_metrics()
        except Exception as exc:  # an engine that cannot be scraped must not stop the loop
            if not self._failing:
                log.warning("engine metrics scrape failed: %s", exc)
            self._failing = True
            self.gov.metrics.set_serving(None)
            return
        self._failing = False
        self.gov.metrics.set_serving(values)

    async def _run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.every_s)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
