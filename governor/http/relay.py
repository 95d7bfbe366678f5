"""Relaying an engine's answer to the client: one state machine for streams, one call for
whole responses, and the accounting of both.

A stream is PENDING until the first byte goes out: until then an error is answered with its
own status and body. Waiting for the engine's first chunk, SSE comments keep the connection
alive every `keepalive_s`; the first comment opens the stream. Once OPEN, every failure —
an engine error, a broken upstream, a bug — leaves as one SSE error event and `[DONE]`, never
as a second status line. The engine iterator is only ever read by the handler itself, so a
client that goes away (aiohttp cancels the handler) cancels the read inside the iterator,
which aborts the engine request; it is closed after, never while it runs. A write that meets
the closing transport first ends the stream the same way, as a client disconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any

from aiohttp import web

from governor.errors import internal_error
from governor.http.common import error_response
from governor.metrics import TenantMeters
from governor.state import Governor
from schemas.engine import APIError, EngineRequest, StreamChunk, Usage

log = logging.getLogger("fak.relay")
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
KEEPALIVE = b": keep-alive\n\n"
DONE = b"data: [DONE]\n\n"


class Relay:
    """One accepted request: its tenant, timings and accounting, as plain fields."""

    def __init__(self, gov: Governor, tenant: str, route: str, meters: TenantMeters,
                 admission_wait_s: float) -> None:
        self.gov, self.tenant, self.route, self.meters = gov, tenant, route, meters
        self.admission_wait_s = admission_wait_s
        self.started = time.monotonic()
        self.first_token_at: float | None = None
        self.usage: Usage | None = None
        self.outcome: str | None = None

    def saw(self, chunk: StreamChunk) -> None:
        if chunk.usage is not None:
            self.usage = chunk.usage
        if self.first_token_at is None and chunk.data and chunk.data.get("choices"):
            self.first_token_at = time.monotonic()

    @property
    def tokens(self) -> int:
        return 0 if self.usage is None else self.usage.total_tokens

    def finish(self, outcome: str) -> None:
        if self.outcome is not None:
            return
        self.outcome = outcome
        m = self.meters
        m.admission_wait.observe(self.admission_wait_s)
        m.count_request(self.route, outcome)
        m.e2e.observe(time.monotonic() - self.started)
        if self.first_token_at is not None:
            m.ttft.observe(self.first_token_at - self.started)
        if self.usage is not None:
            m.prompt_tokens += self.usage.prompt_tokens
            m.completion_tokens += self.usage.completion_tokens
            m.cached_tokens += self.usage.cached_tokens or 0


def sse_event(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def sse_chunk(chunk: StreamChunk) -> bytes:
    if chunk.raw is not None:
        return b"data: " + chunk.raw.encode() + b"\n\n"
    return sse_event(chunk.data or {})


def _usage_only(chunk: StreamChunk) -> bool:
    """The chunk `include_usage` adds: usage, no choices (one the client did not ask for is
    not relayed)."""
    return chunk.usage is not None and chunk.data is not None and chunk.data.get("choices") == []


class SSEStream:
    """The client side of one stream: PENDING (no byte sent), OPEN, or ENDED (its last
    bytes and the body's end sent). Events the engine gave together are written together
    (`StreamChunk.more`): a write is a system call here and a packet for the client."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None
        self.held: list[bytes] = []  # events to write with the next one
        self.ended = False

    @property
    def open(self) -> bool:
        return self.response is not None

    async def _open(self) -> web.StreamResponse:
        if self.response is None:
            self.response = web.StreamResponse(headers=SSE_HEADERS)
            await self.response.prepare(self.request)
        return self.response

    async def send(self, data: bytes, more: bool = False) -> None:
        """Write `data` after what is held, or hold it too where `more` follows at once."""
        if more or self.held:
            self.held.append(data)
            if more:
                return
            data, self.held = b"".join(self.held), []
        await (self.response or await self._open()).write(data)  # once open: no coroutine

    async def end(self, data: bytes) -> None:
        """The last bytes and the body's end, in one write."""
        data, self.held = b"".join(self.held) + data, []
        await (await self._open()).write_eof(data)
        self.ended = True

    async def fail(self, err: APIError) -> web.StreamResponse:
        """The error as the answer (PENDING, nothing held) or as a last event and [DONE]
        after what is held (OPEN)."""
        if self.response is None and not self.held:
            return error_response(err)
        if self.ended:
            assert self.response is not None
            return self.response
        with contextlib.suppress(ConnectionError):
            await self.end(sse_event(err.to_json()) + DONE)
        assert self.response is not None
        return self.response

    def abandon(self) -> web.StreamResponse:
        """The answer to a client that left: the open stream as it is (aiohttp's own ending
        of it meets the closed transport quietly), or a bare error it will never read."""
        return self.response if self.response is not None else error_response(internal_error())

    async def close(self) -> web.StreamResponse:
        """End the stream. A client may leave once it has `[DONE]`, before the end of the
        body reaches it: everything was sent, so that is a finished request."""
        with contextlib.suppress(ConnectionError):
            if not self.ended:
                await self.end(b"")  # sets self.response before it writes
        assert self.response is not None
        return self.response


async def relay_stream(request: web.Request, relay: Relay, engine_request: EngineRequest,
                       client_wants_usage: bool) -> web.StreamResponse:
    gov = relay.gov
    stream = SSEStream(request)
    chunks = gov.driver.generate(engine_request)
    try:
        chunk = await _first(chunks, stream, gov.config.server.keepalive_s)
        while chunk is not None:
            relay.saw(chunk)
            if chunk.done:
                await stream.end(DONE)  # the engine's body end is still read, for its reuse
            elif client_wants_usage or chunk.usage is None or not _usage_only(chunk):
                await stream.send(sse_chunk(chunk), chunk.more)
            chunk = await anext(chunks, None)
    except APIError as err:
        relay.finish("engine_error")
        return await stream.fail(err)
    except asyncio.CancelledError:
        relay.finish("client_disconnect")
        raise
    except ConnectionError:
        # A write met the closing transport before aiohttp cancelled the handler: the client
        # is gone. Nothing more can reach it, and this is no bug to log.
        relay.finish("client_disconnect")
        return stream.abandon()
    except Exception:
        log.exception("stream relay failed for tenant %s", relay.tenant)
        relay.finish("error")
        return await stream.fail(internal_error())
    finally:
        await chunks.aclose()
    relay.finish("ok")
    return await stream.close()


async def _first(chunks: AsyncGenerator[StreamChunk, None], stream: SSEStream,
                 keepalive_s: float) -> StreamChunk | None:
    """The engine's first chunk, read by the handler itself (a task racing a timeout cost a
    task and a loop pass more before the first token); past `keepalive_s` a timer opens the
    stream with comments. A comment being written is finished before the chunk goes out: a
    client gone meanwhile is raised here as the write's ConnectionError."""
    keepalive = _Keepalive(stream, keepalive_s)
    try:
        return await anext(chunks, None)
    except asyncio.CancelledError:
        keepalive.cancel()
        raise
    finally:
        await keepalive.stop()


class _Keepalive:
    """SSE comments every `interval_s` from a timer until stopped, one write at a time: the
    next is armed when one has gone out."""

    def __init__(self, stream: SSEStream, interval_s: float) -> None:
        self.stream, self.interval_s = stream, interval_s
        self.loop = asyncio.get_running_loop()
        self.stopped = False
        self.timer = self.loop.call_later(interval_s, self._due)
        self.writing: asyncio.Task[None] | None = None

    def _due(self) -> None:
        self.writing = self.loop.create_task(self._send())

    async def _send(self) -> None:
        await self.stream.send(KEEPALIVE)
        if not self.stopped:
            self.timer = self.loop.call_later(self.interval_s, self._due)

    async def stop(self) -> None:
        """No comment after this; one in flight is awaited (its failure raised)."""
        self.stopped = True
        self.timer.cancel()
        writing, self.writing = self.writing, None
        if writing is not None:
            await writing

    def cancel(self) -> None:
        """Stop without waiting (the handler is cancelled): a write in flight is cancelled."""
        self.stopped = True
        self.timer.cancel()
        writing, self.writing = self.writing, None
        if writing is not None:
            if writing.done() and not writing.cancelled():
                writing.exception()  # retrieved: no "exception never retrieved" warning
            writing.cancel()


async def relay_once(request: web.Request, relay: Relay,
                     engine_request: EngineRequest) -> web.StreamResponse:
    """The engine's whole answer, written before it is accounted (`Relay.finish` then has
    the client's time too)."""
    chunks: AsyncGenerator[StreamChunk, None] = relay.gov.driver.generate(engine_request)
    try:
        chunk = await anext(chunks)
    except APIError as err:
        relay.finish("engine_error")
        return error_response(err)
    except asyncio.CancelledError:
        relay.finish("client_disconnect")
        raise
    finally:
        await chunks.aclose()
    relay.saw(chunk)
    response = (web.Response(text=chunk.raw, content_type="application/json")
                if chunk.raw is not None else web.json_response(chunk.data))
    try:
        await response.prepare(request)
        await response.write_eof()
    except asyncio.CancelledError:
        relay.finish("client_disconnect")
        raise
    except ConnectionError:  # the client left first; aiohttp writes nothing more to it
        relay.finish("client_disconnect")
        return response
    relay.finish("ok")
    return response
