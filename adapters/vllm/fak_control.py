"""Opt-in client of `fak engine serve`'s cache-control route: exact-span eviction over HTTP.

`fak engine serve --enable-cache-control` mounts two routes no vLLM has, behind a bearer
token of their own (`FAK_CACHE_CONTROL_TOKEN` on the engine's side):

- `GET  /fak/v1/cache/capabilities` → `{"exact_span_evict": true, "int_block_hashes": bool}`;
- `POST /fak/v1/cache/evict_span` with `{namespace, span: {text | messages | token_ids},
  start}` → the engine's own account (`schemas.cache_control.SpanEviction`).

Like the dev-mode reset client it is its own class with its own allowlist of exactly these
two paths, off unless the operator configures its token, and every call is handed to the
audit callback. Against a real vLLM the probe finds nothing (404) and the capability stays
off; the generation client's allowlist never contains these paths.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from schemas.cache_control import SpanEviction, SpanSpec

from .control_plane import bounded_request
from .dev_control import DevControlCall
from .upstream_errors import error_from_body, timed_out, unavailable
from .urls import EngineEndpoint, guarded_url

CAPABILITIES_PATH = "/fak/v1/cache/capabilities"
EVICT_PATH = "/fak/v1/cache/evict_span"
FAK_CONTROL_SURFACES: frozenset[tuple[str, str]] = frozenset(
    {("GET", CAPABILITIES_PATH), ("POST", EVICT_PATH)})


@dataclass(frozen=True, slots=True)
class FakControlConfig:
    base_url: str
    token: str
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        guarded_url(self.base_url, "POST", EVICT_PATH, FAK_CONTROL_SURFACES)
        if not self.token:
            raise ValueError("the cache-control token must not be empty")
        if self.timeout_s <= 0:
            raise ValueError("timeout_s must be positive")

    def __repr__(self) -> str:
        return f"FakControlConfig({self.base_url!r}, token=<redacted>)"


def fak_control_endpoint(base_url: str, method: str, path: str) -> EngineEndpoint:
    """The one constructor of cache-control URLs."""
    return guarded_url(base_url, method, path, FAK_CONTROL_SURFACES)


class FakCacheControlClient:
    def __init__(self, config: FakControlConfig, audit: Callable[[DevControlCall], None]
                 ) -> None:
        self.config = config
        self._audit = audit
        self.int_block_hashes = True

    async def probe(self) -> bool:
        """True when the route is mounted and takes our token (learns the hash form)."""
        response = await self._call("probe_cache_control", "GET", CAPABILITIES_PATH, None)
        if response.status_code != 200:
            return False
        try:
            doc = response.json()
        except ValueError:
            return False
        self.int_block_hashes = doc.get("int_block_hashes", True) is not False
        return doc.get("exact_span_evict") is True

    async def evict_span(self, namespace: str, span: SpanSpec, start: int) -> SpanEviction:
        """The engine's account; a 400 (span unusable) raises ValueError, other failures
        raise the engine's error."""
        body = {"namespace": namespace, "span": span.to_json(), "start": start}
        response = await self._call("evict_span", "POST", EVICT_PATH, body)
        if response.status_code == 400:
            raise ValueError(error_from_body(400, response.content).message)
        if response.status_code != 200:
            raise error_from_body(response.status_code, response.content)
        try:
            return SpanEviction.from_json(response.json())
        except ValueError as exc:
            raise unavailable(f"malformed eviction result: {exc}") from exc

    async def _call(self, action: str, method: str, path: str,
                    body: dict[str, Any] | None) -> httpx.Response:
        endpoint = fak_control_endpoint(self.config.base_url, method, path)
        started, clock = time.time(), time.monotonic()

        def audit(status: int | None, detail: str) -> None:
            self._audit(DevControlCall(action, str(endpoint.url), None, status, detail,
                                       started, time.monotonic() - clock))

        headers = {"Authorization": f"Bearer {self.config.token}"}
        try:
            async with httpx.AsyncClient(timeout=self.config.timeout_s, trust_env=False,
                                         follow_redirects=False) as client:
                response = await bounded_request(client, endpoint.method, endpoint.url,
                                                 json=body, headers=headers)
        except httpx.TimeoutException as exc:
            audit(None, "timeout")
            raise timed_out(f"{method} {path}") from exc
        except httpx.HTTPError as exc:
            audit(None, f"transport error: {type(exc).__name__}")
            raise unavailable(f"{method} {path}: {type(exc).__name__}") from exc
        audit(response.status_code, response.text[:200])
        return response
