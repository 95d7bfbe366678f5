"""KV-cache events of the native engine, published the way vLLM 0.32 does (vllm-surfaces.md §2).

A ZeroMQ PUB socket sends one message per batch, `[topic, seq (8 bytes big-endian), payload]`;
`seq` starts at 0 and grows by 1 per batch; the payload is msgpack `[ts, events,
data_parallel_rank]` with every event a map keyed by name (tag under "type"), or, with
`legacy_array_format`, the positional S3 arrays. The PUB binds when the endpoint contains `*`
or `::` or is ipc:// / inproc://, and connects otherwise. An optional ROUTER replays the last
`buffer_steps` batches to a DEALER sending `["", start_seq]`: one `["", topic, seq, payload]`
per batch with seq >= start_seq, then `["", "", ff×8, ""]`.

ZeroMQ sockets are not thread-safe, so one sender thread owns both sockets; `publish` (any
thread) encodes the batch, numbers it and queues it. Numbering at `publish` time lets callers
know the seq their events went out under (a quarantine watermark).

`KVEventRecorder` is the RadixCache listener: it turns the cache's notifications into
BlockStored / BlockRemoved / AllBlocksCleared records with chained sha256_cbor digests
(native_engine.block_hash) and publishes what piled up as one batch per `flush()`.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal, Protocol

import msgpack
import zmq

from native_engine.block_hash import (
    DIGEST_SIZE,
    NONE_HASH,
    U64_MASK,
    chain_digests,
    hash_to_wire,
    namespace_extra_keys,
)
from schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

log = logging.getLogger(__name__)

END_SEQ = b"\xff" * 8
MEDIUM_GPU = "GPU"
FULL_ATTENTION = "full_attention"
PublisherKind = Literal["zmq", "null"]


# -- configuration ------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_endpoint(name: str, value: Any) -> None:
    if not isinstance(value, str) or "://" not in value:
        raise ValueError(f"{name} must be a ZeroMQ endpoint like 'tcp://*:5557', got {value!r}")


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's `--kv-events-config` keys (same names and defaults) plus two fak flags:
    `legacy_array_format` (S3 positional events instead of maps) and `int_block_hashes`
    (False: whole 32-byte digests, like VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0).
    `publisher` None resolves as vLLM does: "zmq" when events are enabled, else "null"."""

    enable_kv_cache_events: bool = False
    publisher: PublisherKind | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    legacy_array_format: bool = False
    int_block_hashes: bool = True

    def __post_init__(self) -> None:
        for name in ("enable_kv_cache_events", "legacy_array_format", "int_block_hashes"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if self.publisher is None:
            resolved = "zmq" if self.enable_kv_cache_events else "null"
            object.__setattr__(self, "publisher", resolved)
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"publisher must be 'zmq' or 'null', got {self.publisher!r}")
        _check_endpoint("endpoint", self.endpoint)
        if self.replay_endpoint is not None:
            _check_endpoint("replay_endpoint", self.replay_endpoint)
        for name, minimum in (("buffer_steps", 0), ("hwm", 0), ("max_queue_size", 1)):
            value = getattr(self, name)
            if not _is_int(value) or value < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
        if not isinstance(self.topic, str):
            raise ValueError(f"topic must be a string, got {self.topic!r}")

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse a `--kv-events-config '<json>'` value; unknown keys are an error."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(
                f"--kv-events-config has unknown keys {unknown}; allowed: {sorted(known)}"
            )
        return cls(**raw)


def endpoint_binds(endpoint: str) -> bool:
    """vLLM's rule: bind for wildcard/IPv6/ipc/inproc endpoints, connect otherwise."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def offset_endpoint_port(endpoint: str, data_parallel_rank: int) -> str:
    """The endpoint of one data-parallel rank, as vLLM derives it: tcp port + rank, inproc
    name + `_dp{rank}`; rank 0 keeps the endpoint."""
    if data_parallel_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{data_parallel_rank}"
    if "tcp" in endpoint:
        base, _, port = endpoint.rpartition(":")
        if not port.isdigit():
            raise ValueError(f"cannot offset the port of {endpoint!r}")
        return f"{base}:{int(port) + data_parallel_rank}"
    raise ValueError("Invalid endpoint: must contain 'inproc' or 'tcp'")


# -- encoding -----------------------------------------------------------------------------


def _wire_hash(value: Any, int_mode: bool) -> int | bytes:
    if isinstance(value, bytes):
        return hash_to_wire(value, int_mode)
    if _is_int(value):
        if not int_mode:
            raise ValueError("bytes block-hash mode needs digests, got an int hash")
        if not 0 <= value <= U64_MASK:
            raise ValueError(f"int block hash {value} is not a uint64")
        return value
    raise TypeError(f"block hash must be bytes or int, got {type(value).__name__}")


def _check_stored(event: BlockStored) -> None:
    n = len(event.block_hashes)
    if n == 0 or event.block_size < 1 or len(event.token_ids) != n * event.block_size:
        raise ValueError(
            f"BlockStored needs {n} blocks x block_size {event.block_size} tokens, "
            f"got {len(event.token_ids)}"
        )
    if event.extra_keys is not None and len(event.extra_keys) != n:
        raise ValueError("BlockStored extra_keys needs one entry per block")


def event_fields(event: KVEvent, int_mode: bool = True) -> list[tuple[str, Any]]:
    """(name, wire value) pairs in vLLM's declaration order."""
    if isinstance(event, BlockStored):
        _check_stored(event)
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


# -- publishers ---------------------------------------------------------------------------


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


class ZmqEventPublisher:
    """PUB (+ optional ROUTER replay) publisher; see the module docstring for the wire.

    Invariants (check_integrity): the replay buffer holds at most `buffer_steps` batches with
    consecutive seqs ending before `next_seq`; seqs are handed out 0, 1, 2, ... in queue order.
    """

    IDLE_WAIT_S = 0.02  # how long the sender waits for a batch before polling replay again
    LINGER_MS = 1000  # on close, how long queued PUB messages may still go out
    REPLAYS_PER_TURN = 16

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        if not _is_int(data_parallel_rank) or data_parallel_rank < 0:
            raise ValueError(f"data_parallel_rank must be an int >= 0, got {data_parallel_rank}")
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self._topic = config.topic.encode()
        self._ctx = zmq.Context()
        self._pub: zmq.Socket | None = None
        self._replay: zmq.Socket | None = None
        try:
            self._open_sockets()
        except Exception:
            self._close_sockets()
            raise
        assert self._pub is not None
        self.pub_address: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_address: str | None = (
            None if self._replay is None else self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        )
        self._queue: queue.Queue[tuple[int, bytes] | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._buffer_lock = threading.Lock()
        self._lock = threading.Lock()
        self._next_seq = 0
        self._closed = False
        self.send_errors = 0
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()

    def _open_sockets(self) -> None:
        endpoint = offset_endpoint_port(self.config.endpoint, self.data_parallel_rank)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.sndhwm = self.config.hwm
        if endpoint_binds(endpoint):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        if self.config.replay_endpoint is not None:
            replay = offset_endpoint_port(self.config.replay_endpoint, self.data_parallel_rank)
            self._replay = self._ctx.socket(zmq.ROUTER)
            # A ROUTER silently drops past its HWM: leave room for one whole replay.
            self._replay.sndhwm = self.config.buffer_steps + 2
            self._replay.bind(replay)

    def _close_sockets(self) -> None:
        if self._pub is not None:
            self._pub.close(linger=self.LINGER_MS)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    @property
    def next_seq(self) -> int:
        """The seq the next published batch will get."""
        return self._next_seq

    def publish(self, events: Sequence[KVEvent], ts: float | None = None) -> int | None:
        if not events:
            return None
        payload = encode_batch(
            time.time() if ts is None else ts,
            events,
            self.data_parallel_rank,
            legacy_array_format=self.config.legacy_array_format,
            int_block_hashes=self.config.int_block_hashes,
        )
        with self._lock:
            if self._closed:
                raise RuntimeError("KV event publisher is closed")
            seq = self._next_seq
            self._enqueue((seq, payload))
            self._next_seq += 1
        return seq

    def _enqueue(self, item: tuple[int, bytes] | None) -> None:
        """Block while the queue is full (dropping would hide a gap from subscribers)."""
        while True:
            try:
                self._queue.put(item, timeout=0.5)
                return
            except queue.Full:
                if not self._thread.is_alive():
                    raise RuntimeError("KV event sender thread has stopped") from None

    def close(self, timeout: float = 5.0) -> None:
        """Send everything queued, then close the sockets (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._thread.is_alive():
                self._enqueue(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("KV event sender did not stop within %.1f s", timeout)

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the sender thread (owns both sockets) --------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                self._serve_replays()
                try:
                    item = self._queue.get(timeout=self.IDLE_WAIT_S)
                except queue.Empty:
                    continue
                if item is None:
                    break
                self._send(*item)
        finally:
            self._close_sockets()

    def _send(self, seq: int, payload: bytes) -> None:
        assert self._pub is not None
        try:
            self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload])
        except zmq.ZMQError:
            self.send_errors += 1
            log.exception("KV event batch %d was not sent (still replayable)", seq)
        with self._buffer_lock:
            self._buffer.append((seq, payload))

    def _serve_replays(self) -> None:
        sock = self._replay
        for _ in range(self.REPLAYS_PER_TURN):
            if sock is None or not sock.poll(0):
                return
            frames = sock.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("Invalid replay request: %d frames", len(frames))
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            with self._buffer_lock:
                batches = [(s, p) for s, p in self._buffer if s >= start]
            try:
                for seq, payload in batches:
                    sock.send_multipart(
                        [identity, b"", self._topic, seq.to_bytes(8, "big"), payload]
                    )
                sock.send_multipart([identity, b"", b"", END_SEQ, b""])
            except zmq.ZMQError:
                log.exception("KV event replay to a client failed")

    def buffered_seqs(self) -> list[int]:
        with self._buffer_lock:
            return [seq for seq, _ in self._buffer]

    def check_integrity(self) -> None:
        seqs = self.buffered_seqs()
        assert len(seqs) <= self.config.buffer_steps, "replay buffer over buffer_steps"
        if seqs:
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "replay buffer has a gap"
            assert seqs[-1] < self._next_seq, "buffered seq not yet handed out"


def make_publisher(config: KVEventsConfig, data_parallel_rank: int = 0) -> EventPublisher:
    """A ZMQ publisher when events are on with publisher "zmq", else a null one (vLLM's rule)."""
    if config.active:
        return ZmqEventPublisher(config, data_parallel_rank)
    return NullEventPublisher()


# -- the radix cache listener -------------------------------------------------------------


class KVEventRecorder:
    """RadixCache listener (native_engine.radix_cache.CacheEventListener) → vLLM events.

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
            return self.publisher.publish(events) if events else None

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
                _check_stored(event)
                assert event.extra_keys is not None
