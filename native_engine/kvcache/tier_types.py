"""The KV tiers' records and the interfaces they meet (native_engine.kvcache.tiers).

`KVAccess` is the device pool's KV (the model runner), `TierEventSink` the KV-event recorder,
`PromotableRequest` what promotion reads of a request; `TierConfig` configures the tiers,
`TierStats` is their metrics view, `TierRemoval` / `SpanRemoval` report a quarantine per tier.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from policies.eviction import RestoreRates


class KVAccess(Protocol):
    """The device pool's KV (native_engine.model.runner.ModelRunner)."""

    def read_kv(self, slots: torch.Tensor) -> torch.Tensor:
        """[layers, 2, len(slots), kv_heads, head_dim] on the CPU."""
        ...

    def write_kv(self, slots: torch.Tensor, kv: torch.Tensor) -> None: ...


@runtime_checkable
class TierEventSink(Protocol):
    """Told of every block a lower tier gains or loses (native_engine.kvcache.events)."""

    def on_tier_stored(self, medium: str, digests: list[bytes], parent: bytes | None,
                       token_ids: list[int], block_size: int,
                       extra_keys: list[tuple[Any, ...] | None] | None) -> None: ...

    def on_tier_removed(self, medium: str, digests: list[bytes]) -> None: ...


class PromotableRequest(Protocol):
    """What promotion reads of a request (native_engine.request.Request)."""

    @property
    def namespace(self) -> str | None: ...

    token_ids: list[int]
    cache_limit: int | None
    block_digests: list[bytes]


@dataclass(frozen=True, slots=True)
class TierConfig:
    """`host_blocks` blocks of host RAM (0: no host tier); a disk tier under `disk_dir` of at
    most `disk_bytes` (None: no disk tier); `rates` decide whether each tier pays."""

    rates: RestoreRates
    host_blocks: int = 0
    disk_dir: Path | None = None
    disk_bytes: int = 0
    pin_memory: bool = False


@dataclass(slots=True)
class TierCounters:
    """Monotonic, in blocks (bytes for the byte counters)."""

    hits: int = 0
    promotions: int = 0
    demotions: int = 0
    restore_failures: int = 0
    bytes_written: int = 0
    bytes_read: int = 0


@dataclass(frozen=True, slots=True)
class TierStats:
    medium: str
    resident_blocks: int
    resident_bytes: int
    capacity_bytes: int
    hits: int
    promotions: int
    demotions: int
    restore_failures: int
    bytes_written: int
    bytes_read: int
    restore_bytes_per_s: float | None
    restore_pays: bool
    prefill_tokens_per_s: float


@dataclass(frozen=True, slots=True)
class TierRemoval:
    """One tier's part of a quarantine: the digests removed, how many blocks of the span
    (or, for a flush, of anything) are still there afterwards, and what failed."""

    medium: str
    removed: frozenset[bytes]
    remaining: int
    errors: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.errors and self.remaining == 0


@dataclass(frozen=True, slots=True)
class SpanRemoval:
    """An exact-span eviction on every tier: the device pool's evicted tokens and each lower
    tier's removal."""

    device_tokens: int
    tiers: tuple[TierRemoval, ...] = ()

    @property
    def ok(self) -> bool:
        return all(t.ok for t in self.tiers)
