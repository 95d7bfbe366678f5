"""The in-process driver over the native engine (docs/design.md §4)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from adapters.native_cache import NativeCacheControl
from native_engine.async_engine import AsyncLLMEngine, EngineState, Liveness, SupervisorConfig
from native_engine.config import EngineConfig
from native_engine.engine import EngineStats, LLMEngine
from native_engine.kvcache.events import KVEventRecorder, MemoryEventPublisher
from native_engine.serve.openai_serving import OpenAIServing, ServingConfig
from schemas.engine import (
    Determinism,
    EngineCapabilities,
    EngineError,
    EngineRequest,
    StreamChunk,
)

if TYPE_CHECKING:
    from native_engine.model.loaded import LoadedModel

SERVED_MODEL_NAME = "smollm2"


@dataclass(frozen=True, slots=True)
class NativeDriverConfig:
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(
        num_blocks=2048, max_model_len=2048, scheduling_policy="priority"))
    served_model_name: str = SERVED_MODEL_NAME
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)

    @classmethod
    def from_section(cls, section: Any,
                     cache_shares: tuple[tuple[str, float], ...] = ()) -> NativeDriverConfig:
        """From the governor's `[engine]` section (kind = "native") and the tenants'
        `cache_share`s."""
        base = cls().engine
        engine = EngineConfig(
            block_size=base.block_size,
            num_blocks=section.num_blocks or base.num_blocks,
            max_model_len=section.max_model_len,
            scheduling_policy="priority",
            model=section.model,
            kv_offloading_size=section.kv_offloading_size,
            kv_disk_dir=section.kv_disk_dir,
            kv_disk_size=section.kv_disk_size,
            cache_shares=cache_shares,
        )
        return cls(engine=engine)


class NativeDriver:
    """Runs the native engine in this process; capabilities are what it implements. Its
    KV events go to memory (`events`), where the cache control reads its evidence."""

    def __init__(self, config: NativeDriverConfig | None = None,
                 engine: LLMEngine | None = None, loaded: LoadedModel | None = None) -> None:
        """`engine`: run this one (its KV events are not ours to read); else build one from
        the config, over `loaded` when given (an already loaded model)."""
        self.config = config or NativeDriverConfig()
        self._engine = engine
        self._loaded = loaded
        self.events = MemoryEventPublisher()
        self.cache_control = NativeCacheControl(self, self.events)
        self.engine: AsyncLLMEngine | None = None
        self.serving: OpenAIServing | None = None
        self._last_stats: EngineStats | None = None
        self.capabilities = EngineCapabilities(
            engine_kind="native", model_id=self.config.served_model_name,
            max_model_len=self.config.engine.model_len, block_size=self.config.engine.block_size,
            cache_salt=True, priority_scheduling=True, exact_span_evict=True,
            prefix_reset=True, cached_tokens_in_usage=True, kv_events=engine is None,
            capacity_isolation=True,
            determinism=Determinism.UNAVAILABLE,
        )

    async def start(self) -> None:
        engine = self._engine
        if engine is None:
            engine = await asyncio.to_thread(LLMEngine.from_config, self.config.engine,
                                             KVEventRecorder(self.events), self._loaded)
        self.engine = AsyncLLMEngine(engine, self.config.supervisor)
        await self.engine.start()
        runner = engine.model_runner
        self.serving = OpenAIServing(
            self.engine, runner.tokenizer, runner.chat_template,
            ServingConfig(self.config.served_model_name, engine.max_model_len,
                          block_size=engine.config.block_size))

    async def close(self) -> None:
        if self.engine is not None:
            await self.engine.close()
            if self.engine.engine.tiers is not None:  # finish the disk tier's writes
                await asyncio.to_thread(self.engine.engine.tiers.close)

    async def retire_namespace(self, namespace: str) -> None:
        """A rotated-out salt: the engine ages its blocks out first (every KV tier)."""
        if self.engine is not None and self.engine.is_alive:
            await self.engine.call(lambda e: e.retire_namespace(namespace))

    def _serving(self) -> OpenAIServing:
        if self.serving is None or self.engine is None or self.engine.liveness().state not in (
                EngineState.ALIVE, EngineState.RESTARTING):  # a restarting engine queues
            raise EngineError(503, "the native engine is not running",
                              type="ServiceUnavailableError")
        return self.serving

    async def generate(self, request: EngineRequest) -> AsyncGenerator[StreamChunk, None]:
        """The typed body straight to the serving layer: no second validation, the salt
        and priority as values."""
        serving = self._serving()
        prepared = await serving.prepare_off_loop(request.route, request.body,
                                                  request.cache_salt, request.priority or 0,
                                                  cache_group=request.tenant)
        async for chunk in serving.generate(prepared, request.request_id or uuid.uuid4().hex):
            yield chunk

    async def ready(self) -> bool:
        return await self.alive()

    async def alive(self) -> bool:
        """The engine loop runs (not restarting, dead or closed), as `fak engine serve`'s
        /health reports it."""
        return self.engine is not None and self.engine.is_alive

    def liveness(self) -> Liveness | None:
        """The engine's state, restart count and last crash reason (None before start)."""
        return None if self.engine is None else self.engine.liveness()

    async def models(self) -> dict[str, Any]:
        return self._serving().models(self.config.engine.model or "embedded:SmolLM2-135M")

    async def serving_metrics(self) -> dict[str, float | None]:
        if self.engine is None or not self.engine.is_alive:
            return {}
        stats = await self.engine.stats()
        prev, self._last_stats = self._last_stats, stats
        queries = stats.prefix_query_tokens - (prev.prefix_query_tokens if prev else 0)
        hits = stats.prefix_hit_tokens - (prev.prefix_hit_tokens if prev else 0)
        return {
            "running": stats.num_running, "waiting": stats.num_waiting,
            "kv_usage": stats.kv_usage, "prefix_cache_queries": stats.prefix_query_tokens,
            "prefix_cache_hits": stats.prefix_hit_tokens,
            "prefix_cache_hit_ratio": hits / queries if queries else None,
            "preemptions": stats.num_preemptions, "prompt_tokens": stats.prompt_tokens,
            "generation_tokens": stats.generation_tokens,
        }
