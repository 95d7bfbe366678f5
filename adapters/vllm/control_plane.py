"""The control-plane client of a ridden vLLM: `/health`, `/v1/models`, `/metrics`.

Its own httpx client, small pool and explicit timeouts, so a stalled `/metrics` can never
hold a connection the generation path needs. Each call is single-flight (concurrent callers
share one upstream request) and its answer is kept for a short TTL, so a flood of health
checks or model listings reaches the engine at most once per TTL. Every answer is read
through `bounded_request`: one larger than `max_answer_bytes` (decoded) is refused, so a
broken or hostile upstream cannot fill the governor's memory.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import httpx

from .urls import EngineEndpoint, EngineURLs

T = TypeVar("T")
# A control-plane answer: vLLM 0.32's /metrics is ~54 KB; a listing of many LoRA adapters
# is larger, still far below this.
CONTROL_ANSWER_BYTES = 8 << 20
_FRAMING = frozenset({"content-encoding", "content-length", "transfer-encoding"})


class AnswerTooLarge(httpx.HTTPError):
    """The upstream's answer was larger than the bound it is read with."""


async def bounded_request(client: httpx.AsyncClient, method: str, url: httpx.URL | str,
                          limit: int = CONTROL_ANSWER_BYTES, **kwargs: Any) -> httpx.Response:
    """`client.request`, its answer read whole, or AnswerTooLarge past `limit` bytes of
    decoded body (the connection is closed then)."""
    request = client.build_request(method, url, **kwargs)
    response = await client.send(request, stream=True)
    body = bytearray()
    try:
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) > limit:
                raise AnswerTooLarge(f"{method} {request.url.path}: answer over {limit} bytes")
    finally:
        await response.aclose()
    headers = [(k, v) for k, v in response.headers.multi_items() if k.lower() not in _FRAMING]
    return httpx.Response(response.status_code, headers=headers, content=bytes(body),
                          request=request)


@dataclass(frozen=True, slots=True)
class ControlPlaneConfig:
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 5.0
    max_connections: int = 4
    health_ttl_s: float = 1.0
    models_ttl_s: float = 5.0
    max_answer_bytes: int = CONTROL_ANSWER_BYTES
    # An idle pooled connection is dropped before the engine's own idle timeout (uvicorn's
    # 5 s under vLLM, as long as the metrics scrape's period): else a call can go out on a
    # connection the engine is closing and fail (measured against a 1 s server timeout).
    keepalive_s: float = 4.0

    def __post_init__(self) -> None:
        if min(self.connect_timeout_s, self.read_timeout_s, self.keepalive_s) <= 0 or \
                self.max_connections < 1:
            raise ValueError("timeouts must be positive and max_connections >= 1")
        if self.max_answer_bytes < 1:
            raise ValueError("max_answer_bytes must be >= 1")
        if min(self.health_ttl_s, self.models_ttl_s) < 0:
            raise ValueError("TTLs must be >= 0")


class SingleFlight(Generic[T]):
    """One call in flight at a time; its result (or error) served for `ttl_s` after."""

    def __init__(self, call: Callable[[], Awaitable[T]], ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._call, self._ttl_s, self._clock = call, ttl_s, clock
        self._pending: asyncio.Future[T] | None = None
        self._done_at = float("-inf")

    async def get(self) -> T:
        fresh = self._clock() - self._done_at < self._ttl_s
        if self._pending is None or not (fresh or not self._pending.done()):
            self._pending = asyncio.ensure_future(self._run())
        return await asyncio.shield(self._pending)

    async def _run(self) -> T:
        try:
            return await self._call()
        finally:
            self._done_at = self._clock()


class ControlPlane:
    def __init__(self, urls: EngineURLs, headers: dict[str, str],
                 config: ControlPlaneConfig | None = None) -> None:
        self.urls = urls
        self.config = config or ControlPlaneConfig()
        c = self.config
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=c.connect_timeout_s, read=c.read_timeout_s,
                                  write=c.read_timeout_s, pool=c.read_timeout_s),
            limits=httpx.Limits(max_connections=c.max_connections,
                                keepalive_expiry=c.keepalive_s),
            headers=headers, follow_redirects=False, trust_env=False)
        self._health = SingleFlight(self._get_health, c.health_ttl_s)
        self._models = SingleFlight(self._get_models, c.models_ttl_s)

    async def close(self) -> None:
        await self.client.aclose()

    async def healthy(self) -> bool:
        return await self._health.get()

    async def models(self) -> httpx.Response:
        return await self._models.get()

    async def version(self) -> str | None:
        """What `GET /version` answers now (None: no usable answer)."""
        endpoint = self.urls.version()
        try:
            response = await self._get(endpoint)
            version = response.json().get("version") if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        return version if isinstance(version, str) else None

    async def _get_health(self) -> bool:
        endpoint = self.urls.health()
        try:
            response = await self._get(endpoint)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def _get_models(self) -> httpx.Response:
        return await self._get(self.urls.models())

    async def _get(self, endpoint: EngineEndpoint) -> httpx.Response:
        return await bounded_request(self.client, endpoint.method, endpoint.url,
                                     self.config.max_answer_bytes)
