"""`VLLMDriver`: the EngineDriver over a vLLM server's OpenAI-compatible HTTP surface.

Every generation request carries the governor's `cache_salt` (a request without one is
refused before sending); `priority` is sent only when the engine declared priority
scheduling, and a client-supplied one is always dropped. Streams are relayed one SSE event per
chunk. Upstream errors keep vLLM's status and error JSON; transport failures become 502
(refused, reset, cut short) or 504 (timeouts). Closing the generator (client disconnect)
closes the upstream connection, which makes vLLM abort the request. Redirects are never
followed (they could leave the allowlist).

Generation rides one long-lived aiohttp session per upstream (sized keep-alive pool, no
cookie jar): its pool does constant work per request, where httpx's grows with the pool
(issue 19). Capability probes and the control plane (health, models, metrics) stay on httpx.

Upstream isolation is probed, not assumed (SEC-16): `start()` probes the capabilities
(adapters/vllm/capabilities.py) and refuses; after a reconnect — a refused or broken
connection, `/health` failing, or the KV stream showing an engine restart — the engine gets
no request until a re-probe passed (`ensure_probed`), and while it is refused every request
is answered 503 with the reason. Re-probes are at most one per `reprobe_interval_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import httpx
import orjson
from yarl import URL

from schemas.engine import (
    OFF_LOOP_BYTES,
    EngineCapabilities,
    EngineError,
    EngineRequest,
    StreamChunk,
)

from .cache_control import VLLMCacheControl
from .capabilities import CapabilityRefusedError, VLLMDeclarations, probe_capabilities
from .control_plane import AnswerTooLarge, ControlPlane, ControlPlaneConfig
from .dev_control import VLLMDevControl
from .fak_control import FakCacheControlClient
from .kv_subscriber import KVEventSubscriber
from .metrics import (
    MetricsParseError,
    MetricsScrapeError,
    MetricsSnapshot,
    scrape,
    scrape_loads,
    serving_metrics,
)
from .sse import MalformedUpstreamError, SSEFramer, chunk_from_body, chunk_from_event_data
from .upstream_errors import (
    EngineNotReached,
    connect_failed,
    connect_timed_out,
    error_from_body,
    timed_out,
    unavailable,
)
from .urls import EngineURLs, ForbiddenURLError

T = TypeVar("T")
RANK_HEADER = "X-data-parallel-rank"
DONE_GRACE_S = 1.0  # after [DONE], how long the body's end is awaited (see _body_end)


@dataclass(frozen=True, slots=True)
class VLLMHTTPConfig:
    """How to reach the engine.

    `first_byte_timeout_s` bounds the wait for the response head (a free pooled connection
    included) and, for streams, the first SSE event; a non-streaming response arrives whole,
    so it bounds the whole generation there. `total_timeout_s` bounds every upstream read of
    one request from its start. `keepalive_s` is how long an idle pooled connection is kept,
    by the generation session and the control plane alike: below the engine's own idle
    timeout (uvicorn's 5 s under vLLM), so a request never lands on a connection the engine
    is closing. `max_answer_bytes` bounds what one answer may make the governor hold: a
    whole answer, an error body, one SSE event (give or take one read); past it the request
    fails with a 502 and its connection is closed (vLLM aborts the request), so a broken or
    hostile upstream cannot fill the governor's memory.
    """

    base_url: str
    connect_timeout_s: float = 5.0
    first_byte_timeout_s: float = 300.0
    total_timeout_s: float = 900.0
    api_key: str | None = None
    max_connections: int = 512
    probe_timeout_s: float = 120.0
    reprobe_interval_s: float = 1.0
    metrics_url: str | None = None
    keepalive_s: float = 4.0
    max_answer_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        EngineURLs(self.base_url)
        self.metrics_urls()
        if min(self.connect_timeout_s, self.first_byte_timeout_s, self.total_timeout_s,
               self.probe_timeout_s, self.keepalive_s) <= 0:
            raise ValueError("timeouts must be positive")
        if self.reprobe_interval_s < 0:
            raise ValueError("reprobe_interval_s must be >= 0")
        if self.first_byte_timeout_s > self.total_timeout_s:
            raise ValueError("first_byte_timeout_s cannot exceed total_timeout_s")
        if self.max_connections <= 0 or self.max_answer_bytes <= 0:
            raise ValueError("max_connections and max_answer_bytes must be positive")


    def metrics_urls(self) -> EngineURLs:
        """Where `/metrics` is: `metrics_url` (…/metrics) when given, else the base URL."""
        if self.metrics_url is None:
            return EngineURLs(self.base_url)
        if not self.metrics_url.endswith("/metrics"):
            raise ValueError(f"metrics_url must end with /metrics: {self.metrics_url!r}")
        return EngineURLs(self.metrics_url[: -len("/metrics")])


def forwarded_body(
    request: EngineRequest, priority_scheduling: bool, model_id: str
) -> dict[str, Any]:
    """The body vLLM receives: the governor's salt, priority and stream, the checked
    client fields otherwise (serialised once, here)."""
    if not request.cache_salt:
        raise EngineError(status=500, message="refusing to forward a request without a cache salt")
    body = request.body.wire()
    body.pop("priority", None)
    body["cache_salt"] = request.cache_salt
    body["stream"] = request.stream
    body.setdefault("model", model_id)
    if priority_scheduling and request.priority is not None:
        body["priority"] = request.priority
    return body


def encode_body(body: dict[str, Any]) -> bytes:
    """The JSON bytes sent upstream: compact UTF-8, through orjson (4 us → 0.2 us for a
    short body; 65 → 5 ms for 975,000 token ids, time the GIL is held), or the standard
    library for what orjson refuses (integers past 64 bits). Both write the same values:
    every float is finite here (request_fields bounds each typed one; `wire()` writes a
    non-finite untyped one as null)."""
    try:
        return orjson.dumps(body)
    except orjson.JSONEncodeError:
        return json.dumps(body, ensure_ascii=False, separators=(",", ":"),
                          allow_nan=False).encode()


def forwarded_bytes(request: EngineRequest, priority_scheduling: bool, model_id: str) -> bytes:
    """`forwarded_body`, encoded: one call, so a large body does both on a worker thread."""
    return encode_body(forwarded_body(request, priority_scheduling, model_id))


def open_session(config: VLLMHTTPConfig, headers: dict[str, str]) -> aiohttp.ClientSession:
    """The generation session: one per upstream, for the driver's life."""
    connector = aiohttp.TCPConnector(limit=config.max_connections, limit_per_host=0,
                                     keepalive_timeout=config.keepalive_s)
    return aiohttp.ClientSession(
        connector=connector, headers=headers, cookie_jar=aiohttp.DummyCookieJar(),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=config.connect_timeout_s),
        trust_env=False, raise_for_status=False)


class VLLMDriver:
    """EngineDriver for a ridden vLLM. `start()` probes capabilities unless given."""

    def __init__(
        self,
        config: VLLMHTTPConfig,
        declarations: VLLMDeclarations | None = None,
        *,
        capabilities: EngineCapabilities | None = None,
        kv: KVEventSubscriber | None = None,
        reset_route: VLLMDevControl | None = None,
        fak_control: FakCacheControlClient | None = None,
    ) -> None:
        self.config = config
        self.urls = EngineURLs(config.base_url)
        self.metrics_urls = config.metrics_urls()
        self._declarations = declarations or VLLMDeclarations()
        self._given_capabilities = capabilities
        self.kv = kv
        self.dev_control = reset_route
        self.fak_control = fak_control
        self.cache_control = VLLMCacheControl(self)
        self._session: aiohttp.ClientSession | None = None
        self._generation_urls = {route: URL(str(self.urls.generation(route).url), encoded=True)
                                 for route in ("chat", "completions")}
        self._control: ControlPlane | None = None
        self._last_metrics: MetricsSnapshot | None = None
        self.capabilities = capabilities or EngineCapabilities(
            engine_kind="vllm", model_id="", notes=("not probed",)
        )
        self._probe_lock = asyncio.Lock()
        self._needs_probe = False
        self._last_probe_at = float("-inf")
        self._kv_restarts = 0
        self.refusal: str | None = None
        self.probes = 0
        self._headers = ({"Authorization": f"Bearer {config.api_key}"} if config.api_key
                         else {})
        # A whole answer's one deadline, on aiohttp's own timer: a timeout context around
        # the exchange cost ~2% of a request's instructions at line rate (callgrind).
        # Not rounded up.
        self._answer_timeout = aiohttp.ClientTimeout(
            total=config.first_byte_timeout_s, sock_connect=config.connect_timeout_s,
            ceil_threshold=math.inf)

    async def start(self) -> None:
        self._session = open_session(self.config, self._headers)
        self._control = ControlPlane(self.urls, self._headers,
                                     ControlPlaneConfig(keepalive_s=self.config.keepalive_s))
        if self.kv is not None:
            await self.kv.start()
        if self._given_capabilities is None:
            await self._probe()

    async def _probe(self) -> None:
        """Probe now; on success adopt the record and bound the KV index by its blocks."""
        self._last_probe_at = asyncio.get_running_loop().time()
        kv_restarts = self._kv_restart_count()
        try:
            async with asyncio.timeout(self.config.probe_timeout_s), \
                    self._probe_client() as client:
                capabilities = await probe_capabilities(
                    client, self.urls, self._declarations, self.kv, self.dev_control,
                    self.metrics_urls)
        except TimeoutError:
            raise CapabilityRefusedError(
                f"capability probe took over {self.config.probe_timeout_s}s") from None
        finally:
            self.probes += 1  # completed probes, passed or refused
        if self.fak_control is not None:
            capabilities = await self._probe_fak_control(self.fak_control, capabilities)
        self.capabilities = capabilities
        if self.kv is not None and capabilities.num_blocks:
            self.kv.set_block_capacity(capabilities.num_blocks)
        self._kv_restarts = kv_restarts
        self._needs_probe = False
        self.refusal = None

    def _probe_client(self) -> httpx.AsyncClient:
        """A probe's own client, closed after it (a one-token completion may take a while;
        probes are rare: start-up, then at most one per `reprobe_interval_s`)."""
        c = self.config
        return httpx.AsyncClient(
            timeout=httpx.Timeout(connect=c.connect_timeout_s, read=c.first_byte_timeout_s,
                                  write=c.connect_timeout_s, pool=c.first_byte_timeout_s),
            headers=self._headers, follow_redirects=False, trust_env=False)

    def _kv_restart_count(self) -> int:
        return sum(self.kv.restarts(r) for r in self.kv.ranks()) if self.kv else 0

    def mark_reconnect(self) -> None:
        """The engine may have restarted: probe it again before the next request."""
        self._needs_probe = True

    async def ensure_probed(self) -> None:
        """Re-probe after a reconnect or restart; EngineNotReached 503 while refused."""
        if self._given_capabilities is not None:
            return
        if self._kv_restart_count() != self._kv_restarts:
            self._needs_probe = True
        if not self._needs_probe:
            return
        async with self._probe_lock:
            loop = asyncio.get_running_loop()
            wait = self._last_probe_at + self.config.reprobe_interval_s - loop.time()
            if self._needs_probe and (self.refusal is None or wait <= 0):
                try:
                    await self._probe()
                except CapabilityRefusedError as exc:
                    self.refusal = str(exc)
        if self._needs_probe:  # nothing was sent
            raise EngineNotReached(status=503, message=f"upstream refused on re-probe: "
                                   f"{self.refusal}", type="ServiceUnavailable")

    async def _probe_fak_control(self, control: FakCacheControlClient,
                                 capabilities: EngineCapabilities) -> EngineCapabilities:
        """A configured cache-control token is a declaration: the route must answer."""
        if not await control.probe():
            raise CapabilityRefusedError(
                "a cache-control token is configured but GET /fak/v1/cache/capabilities did "
                "not accept it (start `fak engine serve --enable-cache-control` with the "
                "same FAK_CACHE_CONTROL_TOKEN)")
        return dataclasses.replace(
            capabilities, exact_span_evict=True, probed=(*capabilities.probed, "exact_span_evict"),
            notes=(*capabilities.notes, "exact_span_evict probed on the fak control route"))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._control is not None:
            await self._control.close()
            self._control = None
        if self.kv is not None:
            await self.kv.close()

    def _require_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise EngineError(
                status=503, message="vLLM driver not started", type="ServiceUnavailable"
            )
        return self._session

    def _require_control(self) -> ControlPlane:
        if self._control is None:
            raise EngineError(
                status=503, message="vLLM driver not started", type="ServiceUnavailable"
            )
        return self._control

    async def ready(self) -> bool:
        """Healthy, and probed since the last reconnect."""
        if self._control is None:
            return False
        if not await self._control.healthy():
            self.mark_reconnect()
            return False
        try:
            await self.ensure_probed()
        except EngineError:
            return False
        return True

    async def alive(self) -> bool:
        """The driver is up; whether vLLM answers is readiness, not this process's life."""
        return self._session is not None

    async def models(self) -> dict[str, Any]:
        control = self._require_control()
        deadline = asyncio.get_running_loop().time() + control.config.read_timeout_s + 1
        response = await _guarded(control.models(), deadline)
        if response.status_code != 200:
            raise error_from_body(response.status_code, response.content)
        try:
            return chunk_from_body(response.content).data or {}
        except MalformedUpstreamError as exc:
            raise unavailable(str(exc)) from exc

    async def scrape(self) -> MetricsSnapshot:
        """One `/metrics` scrape of this engine (EngineError 502 when it fails)."""
        return await self._metrics(scrape)

    async def engine_loads(self) -> dict[str, float] | None:
        """Running plus waiting requests per DP rank, from one `/metrics` scrape that reads
        the load gauges only (EngineError 502 when it fails)."""
        return await self._metrics(scrape_loads)

    async def _metrics(self, read: Callable[..., Awaitable[T]]) -> T:
        try:
            control = self._require_control()
            return await read(control.client, self.metrics_urls,
                              self.capabilities.model_id or None, control.config.max_answer_bytes)
        except (MetricsScrapeError, MetricsParseError) as exc:
            raise unavailable(f"metrics: {exc}") from exc

    async def version_changed(self) -> bool:
        """`/version` now differs from what the last probe read: the engine was replaced,
        so it is re-probed before its next request."""
        version = await self._require_control().version()
        changed = version is not None and version != self.capabilities.engine_version
        if changed:
            self.mark_reconnect()
        return changed

    async def serving_metrics(self) -> dict[str, float | None]:
        """Normalised metrics over the window since the previous call (first: since start)."""
        snapshot = await self.scrape()
        window = serving_metrics(snapshot, self._last_metrics)
        self._last_metrics = snapshot
        return dataclasses.asdict(window)

    async def generate(self, request: EngineRequest,
                       dp_rank: int | None = None) -> AsyncGenerator[StreamChunk, None]:
        """The request on this engine; `dp_rank` pins a data-parallel rank (the
        `X-data-parallel-rank` header, as vLLM reads it)."""
        session = self._require_session()
        await self.ensure_probed()
        url = self._generation_urls.get(request.route)
        if url is None:
            raise ForbiddenURLError(f"unknown generation route {request.route!r}")
        args = (request, self.capabilities.priority_scheduling, self.capabilities.model_id)
        body = (forwarded_bytes(*args) if request.body_bytes < OFF_LOOP_BYTES
                else await asyncio.to_thread(forwarded_bytes, *args))  # large: off the loop
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.total_timeout_s
        first_byte = min(deadline, loop.time() + self.config.first_byte_timeout_s)
        headers = {"Content-Type": "application/json", "X-Request-Id": request.request_id}
        if dp_rank is not None:
            headers[RANK_HEADER] = str(dp_rank)
        limit = self.config.max_answer_bytes
        try:
            if not request.stream:  # one deadline for the whole exchange
                yield await _answer(session.post(url, data=body, headers=headers,
                                                 allow_redirects=False,
                                                 timeout=self._answer_timeout), limit)
                return
            response = await _guarded(session.post(url, data=body, headers=headers,
                                                   allow_redirects=False), first_byte)
        except EngineError as exc:
            self._note_lost(exc)
            raise
        complete = False  # the body was read to its end: the connection may be reused
        try:
            if response.status != 200:
                raw = await _guarded(_read_at_most(response, limit), deadline)
                complete = True
                raise _status_error(response.status, raw)
            async with contextlib.aclosing(
                    _relay_sse(response, first_byte, deadline, limit)) as chunks:
                async for chunk in chunks:
                    yield chunk
            complete = await _body_end(response, deadline)
        except EngineError as exc:
            self._note_lost(exc)
            raise
        finally:
            if complete:
                response.release()
            else:  # cut short (a client gone, an error): vLLM aborts the request
                response.close()

    def _note_lost(self, exc: EngineError) -> None:
        """A lost connection (refused, reset, cut short; not a timeout): the engine may be a
        new one, so it is re-probed before its next request."""
        if _connection_lost(exc):
            self.mark_reconnect()


async def _body_end(response: aiohttp.ClientResponse, deadline: float) -> bool:
    """After `[DONE]` (already relayed): whether the body's end arrived within a short grace,
    so the connection can be reused. The engine sends it at once; reconnecting for every
    stream instead costs a handshake each and, at high rates, SYNs dropped by a full
    backlog (a 1 s retransmit). An engine that holds the stream open is closed on, no error.
    """
    if response.content.is_eof():
        return True
    grace = min(deadline, asyncio.get_running_loop().time() + DONE_GRACE_S)
    try:
        async with asyncio.timeout_at(grace):
            while await response.content.readany():
                pass  # nothing after [DONE] is relayed
    except (TimeoutError, aiohttp.ClientError):
        return False
    return True


async def _answer(post: Any, limit: int) -> StreamChunk:
    """A non-streaming answer of at most `limit` bytes, whole by the deadline `post` carries.
    The connection goes back to the pool, or is closed when the read was cut short (vLLM
    then aborts the request)."""
    try:
        async with post as response:
            status, raw = response.status, await _read_at_most(response, limit)
    except Exception as exc:
        if (mapped := _mapped(exc)) is exc:
            raise
        raise mapped from exc
    if status != 200:
        raise _status_error(status, raw)
    return _decoded(chunk_from_body, raw)


async def _read_at_most(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """The whole body, or a 502 once it passes `limit` bytes."""
    if (response.content_length or 0) > limit:
        raise unavailable(f"the answer is larger than {limit} bytes")
    body = bytearray()
    while data := await response.content.readany():  # no iterator ending in an exception
        body += data
        if len(body) > limit:
            raise unavailable(f"the answer is larger than {limit} bytes")
    return bytes(body)


def _connection_lost(exc: EngineError) -> bool:
    """A refused, reset or broken connection (not a timeout: `_guarded` made those 504s,
    whatever their cause): the engine may be new."""
    return exc.status == 502 and isinstance(exc.__cause__, aiohttp.ClientError)


def _status_error(status: int, raw: bytes) -> EngineError:
    if 300 <= status < 400:
        return unavailable(f"unexpected redirect ({status}); redirects are not followed")
    return error_from_body(status, raw)


def _decoded(decode: Any, *args: Any) -> StreamChunk:
    try:
        return decode(*args)
    except MalformedUpstreamError as exc:
        raise unavailable(str(exc)) from exc


async def _relay_sse(
    response: aiohttp.ClientResponse, first_byte: float, deadline: float, limit: int
) -> AsyncGenerator[StreamChunk, None]:
    """One chunk per SSE data event, through `[DONE]` (`more` on each but the last of a
    read); a stream cut short is a 502, and so is one whose bytes since its last complete
    event pass `limit`."""
    content_type = response.headers.get("Content-Type", "").partition(";")[0]
    if "text/event-stream" not in content_type:
        raise unavailable(f"not an SSE stream: Content-Type is {content_type!r}")
    framer, content, unframed = SSEFramer(), response.content, 0
    # One timer for the stream, not a timeout context for each read (~9% of the relay's
    # CPU): past `first_byte` before the first event, or past `deadline`, reads fail.
    loop = asyncio.get_running_loop()
    expiry, waiting_first = loop.call_at(first_byte, _expire, content), True
    try:
        while True:
            try:
                data = await content.readany()
            except Exception as exc:
                if (mapped := _mapped(exc)) is exc:
                    raise
                raise mapped from exc
            events = framer.feed(data) if data else framer.close()
            unframed = 0 if events else unframed + len(data)
            if unframed > limit:
                raise unavailable(f"an SSE event is larger than {limit} bytes")
            if events and waiting_first:
                expiry.cancel()
                expiry, waiting_first = loop.call_at(deadline, _expire, content), False
            payloads = [event.data for event in events if event.data]
            for i, payload in enumerate(payloads, 1):
                chunk = _decoded(chunk_from_event_data, payload, i < len(payloads))
                yield chunk
                if chunk.done:
                    return
            if not data:
                raise unavailable("stream ended without [DONE]")
    finally:
        expiry.cancel()


def _expire(content: aiohttp.StreamReader) -> None:
    content.set_exception(TimeoutError("the stream's deadline passed"))


async def _guarded(awaitable: Awaitable[T], deadline: float) -> T:
    """Await an upstream step by `deadline`, mapping transport failures to EngineError:
    every timeout is a 504 (a connect that timed out in the kernel too), every other
    transport failure a 502 — aiohttp's on the generation path, httpx's on the control
    plane; a connect that failed is an `EngineNotReached`."""
    try:
        async with asyncio.timeout_at(deadline):
            return await awaitable
    except Exception as exc:
        if (mapped := _mapped(exc)) is exc:
            raise
        raise mapped from exc


def _mapped(exc: Exception) -> Exception:
    """`exc` as the EngineError `_guarded` describes (tested in this order), or itself."""
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return connect_timed_out()
    if isinstance(exc, aiohttp.ClientConnectorError):
        return connect_timed_out() if isinstance(exc.os_error, TimeoutError) \
            else connect_failed(type(exc).__name__)
    if isinstance(exc, TimeoutError):
        return timed_out("no answer within the configured timeout")
    if isinstance(exc, aiohttp.ClientError):
        # The class name only: the exception text can carry the upstream's address.
        return unavailable(type(exc).__name__)
    if isinstance(exc, AnswerTooLarge):
        return unavailable(str(exc))
    if isinstance(exc, httpx.ConnectTimeout):
        return connect_timed_out()
    if isinstance(exc, httpx.TimeoutException):
        return timed_out(type(exc).__name__)
    if isinstance(exc, httpx.ConnectError):
        return connect_failed(type(exc).__name__)
    if isinstance(exc, httpx.TransportError):
        return unavailable(type(exc).__name__)
    return exc
