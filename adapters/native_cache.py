"""Cache control of the in-process native engine: exact spans, resets, KV-event evidence.

The engine's cache listener is a KV-event recorder publishing into memory
(`MemoryEventPublisher`), so a quarantine reads the same evidence a ridden engine's
subscriber would: the `BlockRemoved` set after a watermark, with no lost batch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any, Protocol

from adapters.cache_probe import probe_usage
from native_engine.async_engine import AsyncLLMEngine
from native_engine.cache_control import cut_span
from native_engine.kvcache.events import MemoryEventPublisher
from native_engine.serve.openai_serving import OpenAIServing
from schemas.cache_control import (
    KVMark,
    KVRemoval,
    ResetOutcome,
    ResetResult,
    SpanEviction,
    SpanSpec,
)
from schemas.engine import EngineCapabilities, EngineError, EngineRequest, StreamChunk, Usage
from schemas.kv_events import AllBlocksCleared, BlockRemoved
from schemas.openai import Route


class InProcessEngine(Protocol):
    """What cache control uses of the in-process driver."""

    capabilities: EngineCapabilities
    engine: AsyncLLMEngine | None
    serving: OpenAIServing | None

    def generate(self, request: EngineRequest) -> AsyncGenerator[StreamChunk, None]: ...


class NativeCacheControl:
    def __init__(self, driver: InProcessEngine, events: MemoryEventPublisher) -> None:
        self.driver = driver
        self.events = events

    def _engine(self) -> AsyncLLMEngine:
        engine = self.driver.engine
        if engine is None or not engine.is_alive:
            raise EngineError(503, "the native engine is not running",
                              type="ServiceUnavailableError")
        return engine

    async def evict_span(self, namespace: str, span: SpanSpec, start: int) -> SpanEviction:
        engine = self._engine()
        if self.driver.serving is None:
            raise EngineError(503, "the native engine is not running",
                              type="ServiceUnavailableError")
        tokens = self.driver.serving.span_tokens(span)
        limit = self.driver.capabilities.max_model_len
        if limit is not None and len(tokens) >= limit:
            raise ValueError(f"the span has {len(tokens)} tokens; the engine's context is "
                             f"{limit}")
        report = await engine.call(lambda e: cut_span(e, namespace, tokens, start))
        return report.eviction(len(tokens), start)

    async def reset_prefix_cache(self) -> ResetResult:
        done = await self._engine().reset_prefix_cache()
        return ResetResult(ResetOutcome.SUCCEEDED if done else ResetOutcome.FAILED, 0,
                           f'{{"success":{str(done).lower()}}}')

    async def kv_mark(self, settle_s: float) -> KVMark | None:
        if not self.driver.capabilities.kv_events:
            return None
        return KVMark(((0, self.events.next_seq - 1 if self.events.next_seq else None),))

    async def kv_removal(self, mark: KVMark, done: Callable[[KVRemoval], bool],
                         timeout_s: float) -> KVRemoval:
        deadline = time.monotonic() + timeout_s
        while True:
            evidence = self._removal(mark)
            if done(evidence) or time.monotonic() >= deadline:
                return evidence
            await asyncio.sleep(0.02)

    def _removal(self, mark: KVMark) -> KVRemoval:
        (_, seq), = mark.points
        batches = self.events.since(seq)
        expected = 0 if seq is None else seq + 1
        # The buffer is bounded: evidence is gap-free only if it still starts right after.
        gap_free = not batches or batches[0][0] == expected
        removed = frozenset(h for _, events in batches for e in events
                            if isinstance(e, BlockRemoved) for h in e.block_hashes)
        cleared = any(isinstance(e, AllBlocksCleared) and e.medium is None
                      for _, events in batches for e in events)
        return KVRemoval(gap_free, removed, cleared, expected,
                         batches[-1][0] if batches else None)

    async def probe(self, tenant: str, salt: str, route: Route, body: dict[str, Any],
                    timeout_s: float) -> Usage | None:
        return await probe_usage(self.driver.generate, self.driver.capabilities.model_id,
                                 tenant, salt, route, body, timeout_s)
