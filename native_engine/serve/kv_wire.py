"""KV-cache events on the wire, byte for byte as vLLM 0.32 sends them
(docs/reference/vllm-surfaces.md §2).

One message per batch: `[topic, seq (8 bytes big-endian), payload]`; the payload is msgpack
`[ts, events, data_parallel_rank]` with every event a map keyed by name (tag under "type"),
or, with `legacy_array_format`, the positional S3 arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack

from native_engine.kvcache.block_hash import U64_MASK, hash_to_wire
from native_engine.kvcache.events import check_stored
from schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from schemas.values import is_int

END_SEQ = b"\xff" * 8


def _wire_hash(value: Any, int_mode: bool) -> int | bytes:
    if isinstance(value, bytes):
        return hash_to_wire(value, int_mode)
    if is_int(value):
        if not int_mode:
            raise ValueError("bytes block-hash mode needs digests, got an int hash")
        if not 0 <= value <= U64_MASK:
            raise ValueError(f"int block hash {value} is not a uint64")
        return value
    raise TypeError(f"block hash must be bytes or int, got {type(value).__name__}")


def event_fields(event: KVEvent, int_mode: bool = True) -> list[tuple[str, Any]]:
    """(name, wire value) pairs in vLLM's declaration order."""
    if isinstance(event, BlockStored):
        check_stored(event)
        parent = event.parent_block_hash
        return [
            ("block_hashes", [_wire_hash(h, int_mode) for h in event.block_hashes]),
            ("parent_block_hash", None if parent is None else _wire_hash(parent, int_mode)),
            ("token_ids", list(event.token_ids)),
            ("block_size", event.block_size),
            ("lora_id", event.lora_id),
            ("medium", event.medium),
            ("lora_name", event.lora_name),
            ("extra_keys", None if event.extra_keys is None else list(event.extra_keys)),
            ("group_idx", event.group_idx),
            ("kv_cache_spec_kind", event.kv_cache_spec_kind),
        ]
    if isinstance(event, BlockRemoved):
        return [
            ("block_hashes", [_wire_hash(h, int_mode) for h in event.block_hashes]),
            ("medium", event.medium),
            ("group_idx", event.group_idx),
        ]
    if isinstance(event, AllBlocksCleared):
        return [] if event.medium is None else [("medium", event.medium)]
    raise TypeError(f"not a KV event record: {type(event).__name__}")


def encode_event(
    event: KVEvent, *, legacy_array_format: bool = False, int_block_hashes: bool = True
) -> list[Any] | dict[str, Any]:
    """One event as vLLM 0.32 sends it (a map with "type"), or as an S3 positional array."""
    tag = type(event).__name__
    pairs = event_fields(event, int_block_hashes)
    if not legacy_array_format:
        return {"type": tag, **dict(pairs)}
    values = [tag, *(value for _, value in pairs)]
    if isinstance(event, BlockStored):
        values.append(None)  # kv_cache_spec_sliding_window: arrays carry every declared field
    return values


def encode_batch(
    ts: float,
    events: Sequence[KVEvent],
    data_parallel_rank: int = 0,
    *,
    legacy_array_format: bool = False,
    int_block_hashes: bool = True,
) -> bytes:
    """The msgpack payload `[ts, events, data_parallel_rank]` (the batch stays an array)."""
    encoded = [
        encode_event(e, legacy_array_format=legacy_array_format, int_block_hashes=int_block_hashes)
        for e in events
    ]
    return msgpack.packb([float(ts), encoded, data_parallel_rank], use_bin_type=True)
