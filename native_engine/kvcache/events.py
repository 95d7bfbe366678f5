"""The radix cache's events as vLLM's KV-cache event records, batched per engine step.

`KVEventRecorder` is the RadixCache listener: it turns the cache's notifications into
BlockStored / BlockRemoved / AllBlocksCleared records with chained sha256_cbor digests
(native_engine.kvcache.block_hash) and hands what piled up to an `EventPublisher` as one
batch per `flush()`. The ZeroMQ publisher lives in native_engine.serve.kv_publisher.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence
from typing import Protocol

from native_engine.kvcache.block_hash import (
    DIGEST_SIZE,
    NONE_HASH,
    chain_digests,
    namespace_extra_keys,
)
from schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

log = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"
FULL_ATTENTION = "full_attention"


def check_stored(event: BlockStored) -> None:
    n = len(event.block_hashes)
    if n == 0 or event.block_size < 1 or len(event.token_ids) != n * event.block_size:
        raise ValueError(
            f"BlockStored needs {n} blocks x block_size {event.block_size} tokens, "
            f"got {len(event.token_ids)}"
        )
    if event.extra_keys is not None and len(event.extra_keys) != n:
        raise ValueError("BlockStored extra_keys needs one entry per block")


class EventPublisher(Protocol):
    def publish(self, events: Sequence[KVEvent], ts: float | None = None) -> int | None:
        """Send `events` as one batch; returns its seq (None when nothing was sent)."""
        ...

    def close(self) -> None: ...


class NullEventPublisher:
    """Discards everything (events disabled or `publisher: "null"`)."""

    def publish(self, events: Sequence[KVEvent], ts: float | None = None) -> int | None:
        return None

    def close(self) -> None:
        return None


class MemoryEventPublisher:
    """Keeps the last `capacity` batches in memory, numbered from 0: the in-process engine's
    KV-event stream, read back as quarantine evidence (thread-safe)."""

    def __init__(self, capacity: int = 4096) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self._batches: deque[tuple[int, tuple[KVEvent, ...]]] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self.next_seq = 0

    def publish(self, events: Sequence[KVEvent], ts: float | None = None) -> int | None:
        if not events:
            return None
        with self._lock:
            seq = self.next_seq
            self._batches.append((seq, tuple(events)))
            self.next_seq += 1
        return seq

    def since(self, seq: int | None) -> list[tuple[int, tuple[KVEvent, ...]]]:
        """Batches after `seq` (all kept ones for None), oldest first."""
        with self._lock:
            return [(s, e) for s, e in self._batches if seq is None or s > seq]

    def close(self) -> None:
        return None


class KVEventRecorder:
    """RadixCache listener (native_engine.kvcache.radix_cache.CacheEventListener) → vLLM events.

    The cache names blocks by its own uint64 ids; a removal carries only those ids, and a
    digest needs its parent's digest, so the recorder maps every block the cache holds from
    cache id to sha256_cbor digest. Stored blocks get vLLM's extra keys: `[salt]` for the block
    starting at token 0 of a salted namespace, None otherwise. Events pile up until `flush()`,
    which publishes them as one batch (the engine calls it once per step that changed the
    cache, and after resets or span evictions).

    Invariants (check_integrity): every mapped digest is 32 bytes and no two cache ids share
    one; every pending BlockStored has len(token_ids) == blocks × block_size and one extra
    key per block.
    """

    def __init__(
        self,
        publisher: EventPublisher,
        *,
        medium: str = MEDIUM_GPU,
        root: bytes = NONE_HASH,
    ) -> None:
        self.publisher = publisher
        self.medium = medium
        self.root = root
        self._lock = threading.Lock()
        self._digests: dict[int, bytes] = {}
        self._pending: list[KVEvent] = []
        self.last_batch: tuple[KVEvent, ...] = ()  # what the last flush published
        self.last_seq: int | None = None  # and the seq it went out under
        self.unknown_parents = 0
        self.unknown_removals = 0

    def on_blocks_stored(
        self,
        namespace: str | None,
        block_hashes: list[int],
        parent_block_hash: int | None,
        token_ids: list[int],
        block_size: int,
    ) -> None:
        n = len(block_hashes)
        if n == 0:
            return
        with self._lock:
            parent = None
            if parent_block_hash is not None:
                parent = self._digests.get(parent_block_hash)
                if parent is None:  # the cache told us of a block we never saw stored
                    self.unknown_parents += 1
                    log.error("BlockStored with an unknown parent; event not published")
                    return
            keys = namespace_extra_keys(namespace, 0 if parent is None else 1, n)
            digests = chain_digests(parent, token_ids, block_size, keys, root=self.root)
            self._digests.update(zip(block_hashes, digests, strict=True))
            self._pending.append(
                BlockStored(
                    block_hashes=tuple(digests),
                    parent_block_hash=parent,
                    token_ids=tuple(token_ids),
                    block_size=block_size,
                    medium=self.medium,
                    extra_keys=tuple(keys),
                    group_idx=0,
                    kv_cache_spec_kind=FULL_ATTENTION,
                )
            )

    def on_blocks_removed(self, namespace: str | None, block_hashes: list[int]) -> None:
        with self._lock:
            for cache_id in block_hashes:
                digest = self._digests.pop(cache_id, None)
                if digest is None:
                    self.unknown_removals += 1
                    log.warning("BlockRemoved for a block never stored; not published")
                    continue
                # vLLM sends one removed hash per event.
                self._pending.append(BlockRemoved((digest,), self.medium, 0))

    def on_cleared(self) -> None:
        with self._lock:
            self._digests.clear()
            self._pending.append(AllBlocksCleared())

    def flush(self) -> int | None:
        """Publish the pending events as one batch; returns its seq (None if none pending)."""
        with self._lock:
            events, self._pending = self._pending, []
            self.last_batch = tuple(events)
            self.last_seq = self.publisher.publish(events) if events else None
            return self.last_seq

    def digest_of(self, cache_id: int) -> bytes | None:
        with self._lock:
            return self._digests.get(cache_id)

    @property
    def num_blocks(self) -> int:
        return len(self._digests)

    def check_integrity(self) -> None:
        with self._lock:
            digests = list(self._digests.values())
            pending = list(self._pending)
        assert all(len(d) == DIGEST_SIZE for d in digests)
        assert len(set(digests)) == len(digests), "two cached blocks share a digest"
        for event in pending:
            if isinstance(event, BlockStored):
                check_stored(event)
                assert event.extra_keys is not None
