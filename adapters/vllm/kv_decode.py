"""Decode vLLM KV-cache event messages, every wire version (docs/reference/vllm-surfaces.md §2.2,
§2.4, §2.6).

A message is `[topic, seq (8 bytes big-endian), payload (msgpack)]`. The payload batch is an
array `[ts, events]` (S1) or `[ts, events, dp_rank]` (S2+), or a map (one unshipped commit).
Events are arrays read by position (tag first; shorter arrays accepted, unknown trailing
elements ignored) or maps read by name (tag under "type", unknown keys ignored). Hashes are
folded to uint64: ints masked to 64 bits (S1 `hash()` may be negative), bytes read as their
last 8 bytes big-endian. msgpack does the parsing; anything malformed raises KVDecodeError,
the only exception this module lets out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgpack

from schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch
from schemas.values import all_ints, is_int

U64_MASK = (1 << 64) - 1
END_SEQ = b"\xff" * 8
_MAX_EXTRA_KEY_DEPTH = 16

STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
)
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_MIN_ARRAY_FIELDS = {"BlockStored": 4, "BlockRemoved": 1, "AllBlocksCleared": 0}


class KVDecodeError(ValueError):
    """A KV-event message that does not decode to known records."""



def fold_hash(value: Any) -> int:
    """An ExternalBlockHash (int or bytes) as uint64, the way vLLM folds digests."""
    if is_int(value):
        return value & U64_MASK
    if isinstance(value, bytes):
        if not value:
            raise KVDecodeError("empty bytes block hash")
        return int.from_bytes(value[-8:], "big")
    raise KVDecodeError(f"block hash is neither int nor bytes: {type(value).__name__}")


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise KVDecodeError(f"seq frame has {len(frame)} bytes, expected 8")
    return int.from_bytes(frame, "big")


def _optional(value: Any, check: Callable[[Any], bool], what: str) -> Any:
    if value is None or check(value):
        return value
    raise KVDecodeError(f"{what} has unexpected type {type(value).__name__}")


def _int_list(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all_ints(value):
        raise KVDecodeError(f"{what} is not a list of integers")
    return tuple(value)


def _hash_list(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise KVDecodeError("block_hashes is not a list")
    return tuple(fold_hash(v) for v in value)


def _frozen_key(value: Any, depth: int = 0) -> Any:
    """Extra keys with lists made tuples (records are immutable); depth is bounded."""
    if depth > _MAX_EXTRA_KEY_DEPTH:
        raise KVDecodeError("extra_keys nested too deeply")
    if isinstance(value, list):
        return tuple(_frozen_key(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return {k: _frozen_key(v, depth + 1) for k, v in value.items()}
    return value


def _extra_keys(value: Any) -> tuple[Any, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise KVDecodeError("extra_keys is not a list")
    return tuple(_frozen_key(v) for v in value)


def _stored(f: dict[str, Any]) -> BlockStored:
    block_size = f.get("block_size")
    if not is_int(block_size) or block_size <= 0:
        raise KVDecodeError(f"block_size is not a positive integer: {block_size!r}")
    parent = f.get("parent_block_hash")
    return BlockStored(
        block_hashes=_hash_list(f.get("block_hashes")),
        parent_block_hash=None if parent is None else fold_hash(parent),
        token_ids=_int_list(f.get("token_ids"), "token_ids"),
        block_size=block_size,
        lora_id=_optional(f.get("lora_id"), is_int, "lora_id"),
        medium=_optional(f.get("medium"), lambda v: isinstance(v, str), "medium"),
        lora_name=_optional(f.get("lora_name"), lambda v: isinstance(v, str), "lora_name"),
        extra_keys=_extra_keys(f.get("extra_keys")),
        group_idx=_optional(f.get("group_idx"), is_int, "group_idx"),
        kv_cache_spec_kind=_optional(
            f.get("kv_cache_spec_kind"), lambda v: isinstance(v, str), "kv_cache_spec_kind"
        ),
    )


def _removed(f: dict[str, Any]) -> BlockRemoved:
    return BlockRemoved(
        block_hashes=_hash_list(f.get("block_hashes")),
        medium=_optional(f.get("medium"), lambda v: isinstance(v, str), "medium"),
        group_idx=_optional(f.get("group_idx"), is_int, "group_idx"),
    )


def _cleared(f: dict[str, Any]) -> AllBlocksCleared:
    return AllBlocksCleared(
        medium=_optional(f.get("medium"), lambda v: isinstance(v, str), "medium")
    )


_BUILDERS: dict[str, tuple[tuple[str, ...], Callable[[dict[str, Any]], KVEvent]]] = {
    "BlockStored": (STORED_FIELDS, _stored),
    "BlockRemoved": (REMOVED_FIELDS, _removed),
    "AllBlocksCleared": ((), _cleared),
}


def decode_event(raw: Any) -> KVEvent:
    """One event, positional array or map."""
    if isinstance(raw, list) and raw:
        tag, values = raw[0], raw[1:]
        if tag not in _BUILDERS:
            raise KVDecodeError(f"unknown event type {tag!r}")
        names, build = _BUILDERS[tag]
        if len(values) < _MIN_ARRAY_FIELDS[tag]:
            raise KVDecodeError(
                f"{tag} array has {len(values)} fields, needs {_MIN_ARRAY_FIELDS[tag]}"
            )
        return build(dict(zip(names, values, strict=False)))
    if isinstance(raw, dict):
        tag = raw.get("type")
        if not isinstance(tag, str) or tag not in _BUILDERS:
            raise KVDecodeError(f"unknown event type {tag!r}")
        return _BUILDERS[tag][1](raw)
    raise KVDecodeError(f"event is neither a non-empty array nor a map: {type(raw).__name__}")


def _batch_parts(raw: Any) -> tuple[Any, Any, Any]:
    if isinstance(raw, list) and len(raw) >= 2:
        return raw[0], raw[1], raw[2] if len(raw) > 2 else None
    if isinstance(raw, dict) and "events" in raw:
        return raw.get("ts"), raw["events"], raw.get("data_parallel_rank")
    raise KVDecodeError("payload is neither a [ts, events, dp_rank?] array nor a batch map")


def decode_payload(payload: bytes, seq: int) -> KVEventBatch:
    """One msgpack EventBatch as a KVEventBatch (dp_rank 0 when absent)."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)
    except (ValueError, msgpack.UnpackException, TypeError, RecursionError) as exc:
        raise KVDecodeError(f"payload is not msgpack: {exc!r}") from exc
    ts, events, dp_rank = _batch_parts(raw)
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise KVDecodeError(f"batch ts is not a number: {ts!r}")
    if not isinstance(events, list):
        raise KVDecodeError("batch events is not a list")
    rank = _optional(dp_rank, is_int, "data_parallel_rank")
    return KVEventBatch(
        seq=seq,
        ts=float(ts),
        events=tuple(decode_event(e) for e in events),
        dp_rank=0 if rank is None else rank,
    )


def decode_message(frames: Sequence[bytes]) -> KVEventBatch:
    """A PUB message `[topic, seq, payload]`."""
    if len(frames) != 3:
        raise KVDecodeError(f"message has {len(frames)} frames, expected 3")
    return decode_payload(frames[2], decode_seq(frames[1]))


def decode_replay_reply(frames: Sequence[bytes]) -> KVEventBatch | None:
    """One replay reply as a DEALER receives it; None for the end marker.

    ≤ v0.25: `["", seq, payload]`; ≥ v0.26: `["", topic, seq, payload]`; the end marker has
    the seq frame `ff×8` or an empty payload (docs/reference/vllm-surfaces.md §2.3).
    """
    parts = list(frames[1:]) if frames and frames[0] == b"" else list(frames)
    if len(parts) == 3:
        parts = parts[1:]
    if len(parts) != 2:
        raise KVDecodeError(f"replay reply has {len(frames)} frames")
    seq_frame, payload = parts
    if seq_frame == END_SEQ or not payload:
        return None
    return decode_payload(payload, decode_seq(seq_frame))
