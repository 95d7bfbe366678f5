"""Cache control of a ridden engine over its public surfaces (and the opt-in ones).

- whole-prefix reset: the dev-mode client (`POST /reset_prefix_cache`), only when declared;
- exact-span eviction: `fak engine serve`'s cache-control route, only when its token is
  configured and the probe found it (never on a real vLLM: it has no such route);
- KV-event evidence: the subscriber's watermark and the batches after it, every rank;
- the canary probe: a generation request like any tenant's.

`VLLMCacheControl(driver, dp_rank=r)` is the view of one data-parallel rank (a fleet's
member): the KV evidence of that rank only and probes pinned to it; a reset still resets
the whole server (vLLM resets every DP engine).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any, Protocol

from adapters.cache_probe import probe_usage
from schemas.cache_control import (
    CacheControlUnsupported,
    KVMark,
    KVRemoval,
    ResetResult,
    SpanEviction,
    SpanSpec,
)
from schemas.engine import EngineCapabilities, EngineRequest, StreamChunk, Usage
from schemas.kv_events import AllBlocksCleared, BlockRemoved
from schemas.openai import Route

from .dev_control import VLLMDevControl
from .fak_control import FakCacheControlClient
from .kv_subscriber import KVEventSubscriber, Watermark


class RiddenEngine(Protocol):
    """What cache control uses of the driver (its capabilities change at start-up)."""

    capabilities: EngineCapabilities
    kv: KVEventSubscriber | None
    dev_control: VLLMDevControl | None
    fak_control: FakCacheControlClient | None

    def generate(self, request: EngineRequest,
                 dp_rank: int | None = None) -> AsyncGenerator[StreamChunk, None]: ...


class VLLMCacheControl:
    def __init__(self, driver: RiddenEngine, dp_rank: int | None = None) -> None:
        self.driver = driver
        self.dp_rank = dp_rank

    def _ranks(self, kv: KVEventSubscriber) -> tuple[int, ...]:
        return kv.ranks() if self.dp_rank is None else (self.dp_rank,)

    async def evict_span(self, namespace: str, span: SpanSpec, start: int) -> SpanEviction:
        control = self.driver.fak_control
        if control is None or not self.driver.capabilities.exact_span_evict:
            raise CacheControlUnsupported("this engine offers no exact-span eviction")
        return await control.evict_span(namespace, span, start)

    async def reset_prefix_cache(self) -> ResetResult:
        if self.driver.dev_control is None:
            raise CacheControlUnsupported("no dev-mode reset was declared for this engine")
        return await self.driver.dev_control.reset_prefix_cache()

    async def kv_mark(self, settle_s: float) -> KVMark | None:
        """Each rank's watermark, once the subscriber has caught up (bounded wait; a rank
        whose stream lost batches for good is not waited for: its mark cannot be gap-free)."""
        kv = self.driver.kv
        if kv is None:
            return None
        ranks = self._ranks(kv)
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline and not all(kv.settled(r) for r in ranks):
            await asyncio.sleep(0.05)
        marks = {rank: kv.watermark(rank) for rank in ranks}
        return KVMark(tuple((r, m.seq) for r, m in sorted(marks.items())), marks)

    async def kv_removal(self, mark: KVMark, done: Callable[[KVRemoval], bool],
                         timeout_s: float) -> KVRemoval:
        deadline = time.monotonic() + timeout_s
        while True:
            evidence = self._removal(mark.detail)
            if done(evidence) or time.monotonic() >= deadline:
                return evidence
            await asyncio.sleep(0.05)

    def _removal(self, marks: dict[int, Watermark]) -> KVRemoval:
        kv = self.driver.kv
        assert kv is not None
        evidence = {rank: kv.evidence_since(mark) for rank, mark in marks.items()}
        removed = frozenset(h for ev in evidence.values() for b in ev.batches
                            for e in b.events if isinstance(e, BlockRemoved)
                            for h in e.block_hashes)
        cleared = all(any(isinstance(e, AllBlocksCleared) and e.medium is None
                          for b in ev.batches for e in b.events) for ev in evidence.values())
        first, mark = evidence[min(evidence)], marks[min(marks)]
        return KVRemoval(all(ev.gap_free for ev in evidence.values()), removed, cleared,
                         0 if mark.seq is None else mark.seq + 1,
                         first.batches[-1].seq if first.batches else None)

    async def probe(self, tenant: str, salt: str, route: Route, body: dict[str, Any],
                    timeout_s: float) -> Usage | None:
        generate = functools.partial(self.driver.generate, dp_rank=self.dp_rank)
        return await probe_usage(generate, self.driver.capabilities.model_id,
                                 tenant, salt, route, body, timeout_s)
