"""The governor's TCP listeners, guarded against clients that hold connections hostage.

aiohttp closes an idle keep-alive connection after `keepalive_timeout_s`, but a client that
dribbles a request head byte by byte keeps it open until then. Each connection's protocol
is wrapped (`GuardedProtocol`, plain delegation to aiohttp's own) to add:

- a head deadline: from the first byte of a request head (or from the connection's start)
  the whole head must arrive within `header_timeout_s`, else the connection is closed;
- a per-peer cap: one remote address holds at most `max_connections_per_peer` open
  connections; one more is closed at once.

"Head arrived" is signalled by the app (`HEAD_DONE_KEY` middleware, which runs once aiohttp
has parsed a request's head); "request finished" re-arms the deadline for the next head.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from governor.http.common import Handler

# asyncio's default backlog is 100: a burst of more connects had its SYNs dropped and the
# clients retried after a second (measured: 245 loopback connects took 1.09 s). The kernel
# caps it at net.core.somaxconn.
LISTEN_BACKLOG = 2048


@dataclass
class ListenerGuard:
    """Shared by every connection of one listener. Invariant (check_integrity): the
    per-peer counts equal the open connections per address and none exceeds the cap."""

    header_timeout_s: float
    max_per_peer: int
    on_refused: Callable[[str], None] = lambda reason: None
    peers: dict[str, int] = field(default_factory=dict)
    by_handler: dict[int, GuardedProtocol] = field(default_factory=dict)

    def check_integrity(self) -> None:
        counted: dict[str, int] = {}
        for proto in self.by_handler.values():
            counted[proto.peer] = counted.get(proto.peer, 0) + 1
        assert counted == self.peers
        assert all(n <= self.max_per_peer for n in self.peers.values())


class GuardedProtocol(asyncio.Protocol):
    def __init__(self, inner: RequestHandler, guard: ListenerGuard) -> None:
        self.inner = inner
        self.guard = guard
        self.peer = ""
        self.transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        # The head clock: when the head being read began (None: none is timed), and one
        # timer that may fire early and look again. Arming a timer per request cost ~2% of
        # a request's instructions at line rate (callgrind); this costs one clock read.
        self._head_since: float | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._busy = False
        self._counted = False

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peername = transport.get_extra_info("peername")
        self.peer = str(peername[0]) if peername else "?"
        self.inner.connection_made(transport)
        if self.guard.peers.get(self.peer, 0) >= self.guard.max_per_peer:
            self.guard.on_refused("per_peer_cap")
            transport.close()
            return
        self._counted = True
        self.guard.peers[self.peer] = self.guard.peers.get(self.peer, 0) + 1
        self.guard.by_handler[id(self.inner)] = self
        self._start_head_clock()

    def data_received(self, data: bytes) -> None:
        if not self._busy and self._head_since is None:
            self._start_head_clock()
        self.inner.data_received(data)

    def eof_received(self) -> None:  # aiohttp's handler returns None: close on EOF
        self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._counted:
            self._counted = False
            left = self.guard.peers[self.peer] - 1
            if left:
                self.guard.peers[self.peer] = left
            else:
                del self.guard.peers[self.peer]
            self.guard.by_handler.pop(id(self.inner), None)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    # -- the head deadline -----------------------------------------------------------------

    def head_done(self) -> None:
        self._busy = True
        self._head_since = None

    def request_done(self) -> None:
        self._busy = False

    def _start_head_clock(self) -> None:
        self._head_since = self._loop.time()
        if self._deadline is None:
            self._deadline = self._loop.call_at(
                self._head_since + self.guard.header_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self._busy or self._head_since is None or self.transport is None:
            return  # no head is being read: the next one starts the clock again
        due = self._head_since + self.guard.header_timeout_s
        if self._loop.time() < due:  # a later head than the one this timer was set for
            self._deadline = self._loop.call_at(due, self._expired)
            return
        self.guard.on_refused("header_timeout")
        self.transport.close()


def head_tracking(guard: ListenerGuard) -> Any:
    """The middleware that tells a connection its request head has arrived (first in the
    chain) and, when the handler is done, that the next head's deadline may start."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        proto = guard.by_handler.get(id(request.protocol))
        if proto is not None:
            proto.head_done()
        try:
            return await handler(request)
        finally:
            if proto is not None:
                proto.request_done()

    return middleware


async def start_guarded_site(runner: web.AppRunner, guard: ListenerGuard, host: str,
                             port: int, reuse_port: bool = False) -> asyncio.Server:
    """Listen on (host, port) with every connection's aiohttp protocol guarded;
    `reuse_port` shares the port with other processes (SO_REUSEPORT)."""
    server = runner.server
    assert server is not None, "runner.setup() first"
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: GuardedProtocol(server(), guard), host, port,
                                    reuse_address=True, reuse_port=reuse_port or None,
                                    backlog=LISTEN_BACKLOG)


async def stop_site(listener: asyncio.Server) -> None:
    listener.close()
    with contextlib.suppress(Exception):
        await listener.wait_closed()
