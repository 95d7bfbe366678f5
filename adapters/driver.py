"""The one protocol every engine driver implements (docs/design.md §4).

A driver has two parts: generation (`generate`, with its health and metrics) and cache
control (`cache_control`: exact-span eviction, whole-prefix reset, KV-event evidence after
a watermark, the canary probe). A driver implements the cache-control calls its engine
offers and answers `CacheControlUnsupported` for the rest; its `capabilities` say which
(`exact_span_evict`, `prefix_reset`, `kv_events`). The quarantine service reaches engines
only through this protocol.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from schemas.cache_control import KVMark, KVRemoval, ResetResult, SpanEviction, SpanSpec
from schemas.engine import EngineCapabilities, EngineRequest, StreamChunk, Usage
from schemas.openai import Route


class CacheControl(Protocol):
    async def evict_span(self, namespace: str, span: SpanSpec, start: int) -> SpanEviction:
        """Evict `span` from `start` (and what derives from it) in `namespace` only.
        Raises ValueError for a span the engine cannot take (e.g. start past its end)."""
        ...

    async def reset_prefix_cache(self) -> ResetResult: ...

    async def kv_mark(self, settle_s: float) -> KVMark | None:
        """The KV-event watermark once the stream has caught up (bounded wait); None when
        the engine publishes no KV events to this driver."""
        ...

    async def kv_removal(self, mark: KVMark, done: Callable[[KVRemoval], bool],
                         timeout_s: float) -> KVRemoval:
        """The evidence after `mark`, waiting until `done(evidence)` or the timeout."""
        ...

    async def probe(self, tenant: str, salt: str, route: Route, body: dict[str, Any],
                    timeout_s: float) -> Usage | None:
        """One greedy, one-token request in `salt`'s namespace: its usage (the canary)."""
        ...


@runtime_checkable
class EngineDriver(Protocol):
    """An engine as the governor sees it.

    `generate` yields StreamChunks: for a streaming request one per SSE event the engine
    sent (and a final `done` chunk), for a non-streaming one a single chunk with the whole
    response. Errors are raised as `schemas.engine.EngineError` with the status to answer.
    Closing the iterator early (client disconnect) aborts the engine request.
    """

    capabilities: EngineCapabilities

    @property
    def cache_control(self) -> CacheControl:
        """The engine's cache controls (read-only: each driver has its own kind)."""
        ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def generate(self, request: EngineRequest) -> AsyncGenerator[StreamChunk, None]: ...

    async def ready(self) -> bool:
        """Can take requests now (engine up, reachable, not overloaded)."""
        ...

    async def alive(self) -> bool:
        """This process's side of the engine is alive (a dead in-process engine loop is
        not; an unreachable remote engine is unready, not dead)."""
        ...

    async def models(self) -> dict[str, Any]: ...

    async def serving_metrics(self) -> dict[str, float | None]:
        """The engine's normalised `fak_serving_*` values; None where not exported."""
        ...


@dataclass(frozen=True, slots=True)
class CacheMember:
    """One place a fleet keeps KV blocks (an upstream's data-parallel rank): its name
    (`upstream/rank`), whether it is up now, its capabilities and its cache control."""

    name: str
    up: bool
    capabilities: EngineCapabilities
    cache_control: CacheControl


@runtime_checkable
class Fleet(Protocol):
    """A driver over several engines (adapters/fleet). A quarantine runs on every member
    that can hold the tenant's blocks; `/admin/v1/upstreams` and the per-upstream metrics
    read `upstream_views` and `routing_view`."""

    def cache_members(self) -> tuple[CacheMember, ...]: ...

    def upstream_views(self) -> list[dict[str, Any]]: ...

    def routing_view(self) -> dict[str, Any]: ...
