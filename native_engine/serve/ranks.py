"""Data-parallel ranks of `fak engine serve` (`--data-parallel-size N`), as vLLM lays them out.

One process, N engines: each rank has its own KV pool, prefix cache, scheduler loop, KV-event
publisher (vLLM's port offsets: rank r publishes on port + r, replays on replay port + r, and
stamps `data_parallel_rank = r` in every batch) and its metrics under `engine="r"`. The model
weights are loaded once and shared (read-only). A request names its rank with the
`X-data-parallel-rank` header, as on vLLM; without one it goes to the rank with the fewest
requests in flight (lowest rank on a tie).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, replace

import torch
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from native_engine.async_engine import AsyncLLMEngine, SupervisorConfig
from native_engine.config import EngineConfig
from native_engine.engine import LLMEngine
from native_engine.kvcache.events import EventPublisher, KVEventRecorder
from native_engine.model.loaded import DTYPES, LoadedModel
from native_engine.model.machine import auto_dtype
from native_engine.model.weights import load_model
from native_engine.serve.kv_config import KVEventsConfig
from native_engine.serve.kv_publisher import make_publisher
from native_engine.serve.metrics import CacheInfo, ServerMetrics
from native_engine.serve.openai_serving import OpenAIServing, ServingConfig
from policies.kv_sockets import offset_endpoint_port
from schemas.engine import EngineError

RANK_HEADER = "X-data-parallel-rank"


@dataclass(eq=False)
class RankEngine:
    """One data-parallel rank: its engine, serving front, metrics and KV publisher."""

    rank: int
    engine: AsyncLLMEngine
    serving: OpenAIServing
    metrics: ServerMetrics
    publisher: EventPublisher
    in_flight: int = 0

    @contextlib.contextmanager
    def serving_one(self) -> Iterator[None]:
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1

    async def close(self) -> None:
        await self.engine.close()
        tiers = self.engine.engine.tiers
        if tiers is not None:
            await asyncio.to_thread(tiers.close)
        self.publisher.close()


def pick_rank(ranks: tuple[RankEngine, ...], header: str | None) -> RankEngine:
    """The rank the header names, else the least busy one; a bad header is a 400."""
    if header is None:
        return min(ranks, key=lambda r: (r.in_flight, r.rank))
    try:
        rank = int(header.strip())
    except ValueError:
        rank = -1
    if not 0 <= rank < len(ranks):
        raise EngineError(400, f"data_parallel_rank {header!r} is out of range "
                          f"[0, {len(ranks)})", type="BadRequestError", param=RANK_HEADER)
    return ranks[rank]


@dataclass(frozen=True, slots=True)
class RankSpec:
    """What every rank is built from (the server's config, resolved once)."""

    engine: EngineConfig
    kv_events: KVEventsConfig
    supervisor: SupervisorConfig
    model_name: str
    prompt_tokens_details: bool
    priority_enabled: bool


async def build_ranks(spec: RankSpec, size: int) -> tuple[RankEngine, ...]:
    """Load the model once and start `size` ranks over it; on failure nothing is left open."""
    cfg = spec.engine
    dtype = auto_dtype(torch.device(cfg.device)) if cfg.dtype == "auto" else DTYPES[cfg.dtype]
    loaded = await asyncio.to_thread(load_model, cfg.model, dtype) if size > 1 else None
    ranks: list[RankEngine] = []
    try:
        for rank in range(size):
            ranks.append(await _start_rank(spec, rank, loaded))
    except BaseException:
        for started in ranks:
            await started.close()
        raise
    return tuple(ranks)


async def _start_rank(spec: RankSpec, rank: int, loaded: LoadedModel | None) -> RankEngine:
    publisher = make_publisher(spec.kv_events, rank)
    recorder = KVEventRecorder(publisher) if spec.kv_events.active else None
    try:
        llm = await asyncio.to_thread(LLMEngine.from_config, spec.engine, recorder, loaded)
    except BaseException:
        publisher.close()
        raise
    engine = AsyncLLMEngine(llm, spec.supervisor)
    await engine.start()
    metrics = ServerMetrics(spec.model_name, CacheInfo(
        llm.config.block_size, llm.config.num_blocks, llm.cache is not None), rank,
        compute=llm.model_runner.compute.labels())
    serving = OpenAIServing(
        engine, llm.model_runner.tokenizer, llm.model_runner.chat_template,
        ServingConfig(spec.model_name, llm.max_model_len,
                      prompt_tokens_details=spec.prompt_tokens_details,
                      priority_enabled=spec.priority_enabled,
                      block_size=llm.config.block_size),
        observe=metrics.track)
    return RankEngine(rank, engine, serving, metrics, publisher)


class MergedRegistry:
    """Several ranks' registries exposed as one: samples of a family from every rank under
    one HELP/TYPE (the `engine` label tells them apart), as vLLM's exposition has them."""

    def __init__(self, registries: Iterable[CollectorRegistry]) -> None:
        self.registries = tuple(registries)

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for registry in self.registries:
            for family in registry.collect():
                known = merged.get(family.name)
                if known is None:
                    merged[family.name] = family
                else:
                    known.samples.extend(family.samples)
        yield from merged.values()


def kv_sources(config: KVEventsConfig, size: int) -> Mapping[str, dict[str, object]]:
    """`GET /kv_event_sources`: each rank's KV-event config, ports offset by rank."""
    out = {}
    for rank in range(size):
        replay = config.replay_endpoint
        out[str(rank)] = asdict(replace(
            config, endpoint=offset_endpoint_port(config.endpoint, rank),
            replay_endpoint=None if replay is None else offset_endpoint_port(replay, rank)))
    return out
