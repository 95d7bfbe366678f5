"""Shared setup for the KV-tier tests: engines with forced tier placement."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from native_engine.config import EngineConfig
from native_engine.engine import CompletedRequest, LLMEngine
from native_engine.kvcache.tier_types import TierStats
from native_engine.model.loaded import LoadedModel
from native_engine.request import SamplingParams
from policies.eviction import RestoreRates

GIB = 1 << 30
# Restores always pay: the tests choose placement, the cost model is tested on its own.
ALWAYS_RESTORE = RestoreRates(1.0, {"CPU": 1e15, "DISK": 1e15})


def block_bytes_of(loaded: LoadedModel, block_size: int, dtype_bytes: int = 4) -> int:
    cfg = loaded.config
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * block_size * dtype_bytes


def tier_config(block_bytes: int, host_blocks: int = 0, disk_dir: Path | None = None,
                disk_blocks: int = 64, **kw: object) -> EngineConfig:
    fields: dict[str, object] = {
        "dtype": "float32", "attention_backend": "torch", "kv_restore_rates": ALWAYS_RESTORE}
    if host_blocks:
        fields["kv_offloading_size"] = host_blocks * block_bytes / GIB
    if disk_dir is not None:
        fields["kv_disk_dir"] = str(disk_dir)
        fields["kv_disk_size"] = disk_blocks * (block_bytes + 8192) / GIB
    fields.update(kw)
    return EngineConfig(**fields)  # type: ignore[arg-type]


def build(loaded: LoadedModel, **kw: object) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig(**kw), loaded=loaded)  # type: ignore[arg-type]


def run(engine: LLMEngine, prompt: Sequence[int], params: SamplingParams) -> CompletedRequest:
    out = engine.generate([list(prompt)], params)[0]
    engine.check_integrity()
    return out


def evict_device(engine: LLMEngine) -> int:
    """Evict every unlocked block from the device pool (the tiers demote what they keep)."""
    assert engine.cache is not None
    freed = engine.cache.evict(engine.pool.num_blocks)
    engine.step()  # publish the events of the eviction (nothing is scheduled)
    assert not engine.cache.held_blocks()
    if engine.tiers is not None:
        engine.tiers.drain()  # the disk tier's files are written
    return freed


def tier(engine: LLMEngine, medium: str) -> TierStats:
    return next(s for s in engine.stats().tiers if s.medium == medium)
