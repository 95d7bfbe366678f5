"""The one protocol every engine driver implements (docs/design.md §4)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol, runtime_checkable

from schemas.engine import EngineCapabilities, EngineRequest, StreamChunk


@runtime_checkable
class EngineDriver(Protocol):
    """An engine as the governor sees it.

    `generate` yields StreamChunks: for a streaming request one per SSE event the engine
    sent (and a final `done` chunk), for a non-streaming one a single chunk with the whole
    response. Errors are raised as `schemas.engine.EngineError` with the status to answer.
    Closing the iterator early (client disconnect) aborts the engine request.
    """

    capabilities: EngineCapabilities

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def generate(self, request: EngineRequest) -> AsyncIterator[StreamChunk]: ...

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
