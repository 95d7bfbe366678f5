"""One governor's listeners, started and stopped together: the tenant port (guarded:
head deadline, per-peer cap, keep-alive timeout) and the private metrics port, plus the
timer that scrapes the engine's serving metrics."""

from __future__ import annotations

import asyncio
import os

from aiohttp import web

from governor.http.app import build_app, build_metrics_app
from governor.http.listener import ListenerGuard, start_guarded_site, stop_site
from governor.http.metrics_routes import ServingMetricsRefresher
from governor.secrets import StartupRefused
from governor.state import Governor


class GovernorServer:
    def __init__(self, gov: Governor) -> None:
        self.gov = gov
        server = gov.config.server
        self.guard = ListenerGuard(server.header_timeout_s, server.max_connections_per_peer,
                                   self._refused)
        self.refresher = ServingMetricsRefresher(gov, server.metrics_refresh_s,
                                                 timeout_s=max(1.0, server.metrics_refresh_s))
        self._runners: list[web.AppRunner] = []
        self._listeners: list[asyncio.Server] = []
        self.url = ""
        self.metrics_url = ""

    def _refused(self, reason: str) -> None:
        self.gov.metrics.connections_refused.labels(reason).inc()

    async def start(self, host: str, port: int, metrics_host: str, metrics_port: int,
                    reuse_port: bool = False) -> None:
        """Bind both ports (0: any free port); `url` and `metrics_url` say where.
        `reuse_port`: the tenant port is shared with other workers (SO_REUSEPORT). A port
        that cannot be bound (in use, not permitted) refuses start-up in one line, with
        whatever had started stopped."""
        server = self.gov.config.server
        main = web.AppRunner(build_app(self.gov, self.guard), handler_cancellation=True,
                             keepalive_timeout=server.keepalive_timeout_s,
                             shutdown_timeout=server.drain_timeout_s, access_log=None)
        metrics = web.AppRunner(build_metrics_app(self.gov), access_log=None)
        for runner in (main, metrics):
            await runner.setup()
            self._runners.append(runner)
        binding = f"port {host}:{port}"  # the one being bound, for a refusal
        try:
            listener = await start_guarded_site(main, self.guard, host, port, reuse_port)
            self._listeners.append(listener)
            self.url = _url(listener)
            binding = f"metrics port {metrics_host}:{metrics_port}"
            await web.TCPSite(metrics, metrics_host, metrics_port).start()
        except OSError as exc:
            await self.stop()
            reason = os.strerror(exc.errno) if exc.errno else str(exc)
            raise StartupRefused(f"cannot listen on the {binding}: {reason}") from None
        bound_host, bound_port = metrics.addresses[0][:2]
        self.metrics_url = f"http://{bound_host}:{bound_port}"
        self.refresher.start()

    async def stop(self) -> None:
        await self.refresher.stop()
        for listener in self._listeners:
            await stop_site(listener)
        for runner in self._runners:
            await runner.cleanup()
        self._listeners.clear()
        self._runners.clear()


def _url(listener: asyncio.AbstractServer) -> str:
    host, port = listener.sockets[0].getsockname()[:2]  # type: ignore[attr-defined]
    return f"http://{host}:{port}"
