"""Run a real governor (aiohttp on loopback) in a background thread for sync clients."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from governor.http.server import GovernorServer
from governor.state import Governor

T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """An event loop in a thread; governors are served on it, coroutines run on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self._servers: list[GovernorServer] = []
        self.metrics_urls: dict[str, str] = {}

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 600) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[[], T]) -> T:
        async def wrapper() -> T:
            return fn()

        return self.run(wrapper())

    def serve(self, gov: Governor) -> str:
        """Both listeners on free ports; the tenant URL (its metrics URL: `metrics_urls`)."""
        server = GovernorServer(gov)
        self.run(server.start("127.0.0.1", 0, "127.0.0.1", 0))
        self._servers.append(server)
        self.metrics_urls[server.url] = server.metrics_url
        return server.url

    def stop(self) -> None:
        for server in self._servers:
            self.run(server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
