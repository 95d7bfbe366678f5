"""`VLLMDriver`: the EngineDriver over a vLLM server's OpenAI-compatible HTTP surface.

Every generation request carries the governor's `cache_salt` (a request without one is
refused before sending); `priority` is sent only when the engine declared priority
scheduling, and a client-supplied one is always dropped. Streams are relayed one SSE event per
chunk. Upstream errors keep vLLM's status and error JSON; transport failures become 502/504.
Closing the generator (client disconnect) closes the upstream response, which makes vLLM
abort the request. Redirects are never followed (they could leave the allowlist).

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
from collections.abc import AsyncGenerator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
from httpx_sse import EventSource, SSEError

from schemas.engine import EngineCapabilities, EngineError, EngineRequest, StreamChunk

from .cache_control import VLLMCacheControl
from .capabilities import CapabilityRefusedError, VLLMDeclarations, probe_capabilities
from .control_plane import ControlPlane
from .dev_control import VLLMDevControl
from .fak_control import FakCacheControlClient
from .kv_subscriber import KVEventSubscriber
from .metrics import MetricsParseError, MetricsScrapeError, MetricsSnapshot, scrape, serving_metrics
from .sse import MalformedUpstreamError, chunk_from_body, chunk_from_event_data
from .upstream_errors import error_from_body, timed_out, unavailable
from .urls import EngineURLs

T = TypeVar("T")
RANK_HEADER = "X-data-parallel-rank"


@dataclass(frozen=True, slots=True)
class VLLMHTTPConfig:
    """How to reach the engine.

    `first_byte_timeout_s` bounds the wait for the response head and, for streams, the first
    SSE event; a non-streaming response arrives whole, so it bounds the whole generation
    there. `total_timeout_s` bounds every upstream read of one request from its start.
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

    def __post_init__(self) -> None:
        EngineURLs(self.base_url)
        self.metrics_urls()
        if min(self.connect_timeout_s, self.first_byte_timeout_s, self.total_timeout_s,
               self.probe_timeout_s) <= 0:
            raise ValueError("timeouts must be positive")
        if self.reprobe_interval_s < 0:
            raise ValueError("reprobe_interval_s must be >= 0")
        if self.first_byte_timeout_s > self.total_timeout_s:
            raise ValueError("first_byte_timeout_s cannot exceed total_timeout_s")
        if self.max_connections <= 0:
            raise ValueError("max_connections must be positive")


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
        self._client: httpx.AsyncClient | None = None
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

    async def start(self) -> None:
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(
                connect=self.config.connect_timeout_s,
                read=None,
                write=self.config.connect_timeout_s,
                pool=self.config.first_byte_timeout_s,
            ),
            limits=httpx.Limits(max_connections=self.config.max_connections),
            headers=headers,
            follow_redirects=False,
            trust_env=False,
        )
        self._control = ControlPlane(self.urls, headers)
        if self.kv is not None:
            await self.kv.start()
        if self._given_capabilities is None:
            await self._probe()

    async def _probe(self) -> None:
        """Probe now; on success adopt the record and bound the KV index by its blocks."""
        self._last_probe_at = asyncio.get_running_loop().time()
        kv_restarts = self._kv_restart_count()
        try:
            async with asyncio.timeout(self.config.probe_timeout_s):
                capabilities = await probe_capabilities(
                    self._require_client(), self.urls, self._declarations, self.kv,
                    self.dev_control, self.metrics_urls)
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

    def _kv_restart_count(self) -> int:
        return sum(self.kv.restarts(r) for r in self.kv.ranks()) if self.kv else 0

    def mark_reconnect(self) -> None:
        """The engine may have restarted: probe it again before the next request."""
        self._needs_probe = True

    async def ensure_probed(self) -> None:
        """Re-probe after a reconnect or restart; EngineError 503 while refused."""
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
        if self._needs_probe:
            raise EngineError(status=503, message=f"upstream refused on re-probe: "
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
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        if self._control is not None:
            await self._control.close()
            self._control = None
        if self.kv is not None:
            await self.kv.close()

    def _require_client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise EngineError(
                status=503, message="vLLM driver not started", type="ServiceUnavailable"
            )
        return self._client

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
        return self._client is not None

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
        try:
            return await scrape(self._require_control().client, self.metrics_urls,
                                self.capabilities.model_id or None)
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
        client = self._require_client()
        await self.ensure_probed()
        endpoint = self.urls.generation(request.route)
        body = forwarded_body(
            request, self.capabilities.priority_scheduling, self.capabilities.model_id
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.total_timeout_s
        first_byte = min(deadline, loop.time() + self.config.first_byte_timeout_s)
        headers = {"X-Request-Id": request.request_id}
        if dp_rank is not None:
            headers[RANK_HEADER] = str(dp_rank)
        upstream = client.build_request(endpoint.method, endpoint.url, json=body,
                                        headers=headers)
        try:
            response = await _guarded(client.send(upstream, stream=True), first_byte)
        except EngineError as exc:
            if _connection_lost(exc):
                self.mark_reconnect()
            raise
        try:
            if response.status_code != 200:
                raise _status_error(
                    response.status_code, await _guarded(response.aread(), deadline)
                )
            if not request.stream:
                yield _decoded(chunk_from_body, await _guarded(response.aread(), first_byte))
                return
            async with contextlib.aclosing(_relay_sse(response, first_byte, deadline)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            await response.aclose()


def _connection_lost(exc: EngineError) -> bool:
    """A refused, reset or broken connection (not a timeout): the engine may be new."""
    cause = exc.__cause__
    return isinstance(cause, httpx.TransportError) and not isinstance(
        cause, httpx.TimeoutException)


def _status_error(status: int, raw: bytes) -> EngineError:
    if 300 <= status < 400:
        return unavailable(f"unexpected redirect ({status}); redirects are not followed")
    return error_from_body(status, raw)


def _decoded(decode: Any, raw: Any) -> StreamChunk:
    try:
        return decode(raw)
    except MalformedUpstreamError as exc:
        raise unavailable(str(exc)) from exc


async def _relay_sse(
    response: httpx.Response, first_byte: float, deadline: float
) -> AsyncGenerator[StreamChunk, None]:
    """One chunk per SSE data event, through `[DONE]`; a stream cut short is a 502."""
    events = EventSource(response).aiter_sse()
    waiting_for = first_byte
    try:
        while True:
            event = await _guarded(anext(events, None), waiting_for)
            waiting_for = deadline
            if event is None:
                raise unavailable("stream ended without [DONE]")
            if not event.data:
                continue
            chunk = _decoded(chunk_from_event_data, event.data)
            yield chunk
            if chunk.done:
                return
    except SSEError as exc:
        raise unavailable(f"not an SSE stream: {exc}") from exc
    finally:
        await events.aclose()


async def _guarded(awaitable: Awaitable[T], deadline: float) -> T:
    """Await an upstream step by `deadline`, mapping transport failures to EngineError."""
    try:
        async with asyncio.timeout_at(deadline):
            return await awaitable
    except TimeoutError as exc:
        raise timed_out("no answer within the configured timeout") from exc
    except httpx.ConnectTimeout as exc:
        raise timed_out("connect timed out") from exc
    except httpx.TimeoutException as exc:
        raise timed_out(type(exc).__name__) from exc
    except httpx.TransportError as exc:
        # The class name only: the exception text can carry the upstream's address.
        raise unavailable(type(exc).__name__) from exc
