"""KV-cache events (docs/design.md §5). A subscriber's are normalised: hashes uint64 (bytes
folded, ints masked). A publisher's carry the engine's own digests (bytes for sha256_cbor)
until the wire encodes them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

BlockHash = int | bytes  # as an engine's KV events carry it


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    medium: str | None = None


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """One published batch: `seq` from the frame, `dp_rank` from the payload (0 if absent)."""

    seq: int
    ts: float
    events: tuple[KVEvent, ...] = field(default_factory=tuple)
    dp_rank: int = 0
