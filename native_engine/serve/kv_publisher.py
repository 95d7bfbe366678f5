"""The ZeroMQ publisher of `fak engine serve`'s KV-cache events (docs/reference/vllm-surfaces.md
§2).

A PUB socket sends one message per batch (native_engine.serve.kv_wire); `seq` starts at 0
and grows by 1 per batch. The PUB binds when the endpoint contains `*` or `::` or is
ipc:// / inproc://, and connects otherwise; without `allow_remote_kv` a wildcard bind listens
on loopback only (SEC-17: the stream carries every tenant's tokens and salts). An optional
ROUTER replays the last `buffer_steps` batches to a DEALER sending `["", start_seq]`: one
`["", topic, seq, payload]` per batch with seq >= start_seq, then `["", "", ff×8, ""]`;
batches still queued when a request arrives are sent first, so a replay holds every batch
published before it.

ZeroMQ sockets are not thread-safe, so one sender thread owns both sockets; `publish` (any
thread) encodes the batch, numbers it and queues it. Numbering at `publish` time lets callers
know the seq their events went out under (a quarantine watermark).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence

import zmq

from native_engine.kvcache.events import EventPublisher, NullEventPublisher
from native_engine.serve.kv_config import KVEventsConfig, endpoint_binds
from native_engine.serve.kv_wire import END_SEQ, encode_batch
from policies.kv_sockets import offset_endpoint_port
from schemas.kv_events import KVEvent
from schemas.values import is_int

log = logging.getLogger(__name__)


class PublisherSocketError(RuntimeError):
    """A KV-event socket could not be bound or connected (a port in use, say)."""


def _attach(sock: zmq.Socket[bytes], address: str, bind: bool) -> None:
    """Bind or connect `sock`; a failure names the address and why, in one line."""
    try:
        if bind:
            sock.bind(address)
        else:
            sock.connect(address)
    except zmq.ZMQError as exc:
        side = "bind" if bind else "connect"
        reason = zmq.strerror(exc.errno) if exc.errno else str(exc)
        raise PublisherSocketError(f"KV events: cannot {side} {address}: {reason}") from None


class ZmqEventPublisher:
    """PUB (+ optional ROUTER replay) publisher; see the module docstring for the wire.

    Invariants (check_integrity): the replay buffer holds at most `buffer_steps` batches with
    consecutive seqs ending before `next_seq`; seqs are handed out 0, 1, 2, ... in queue order.
    """

    IDLE_WAIT_S = 0.02  # how long the sender waits for a batch before polling replay again
    LINGER_MS = 1000  # on close, how long queued PUB messages may still go out
    REPLAYS_PER_TURN = 16

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        if not is_int(data_parallel_rank) or data_parallel_rank < 0:
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
        self._buffer_lock: threading.Lock = threading.Lock()
        self._lock: threading.Lock = threading.Lock()
        self._next_seq: int = 0
        self._closed: bool = False
        self._stopping: bool = False  # the sender thread took close()'s sentinel
        self.send_errors: int = 0
        self._thread: threading.Thread = threading.Thread(
            target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()

    def _open_sockets(self) -> None:
        endpoint = offset_endpoint_port(self.config.endpoint, self.data_parallel_rank)
        address = self.config.socket_address(endpoint, "PUB")
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.sndhwm = self.config.hwm
        self._pub.ipv6 = "[" in address
        _attach(self._pub, address, endpoint_binds(endpoint))
        if self.config.replay_endpoint is not None:
            replay = offset_endpoint_port(self.config.replay_endpoint, self.data_parallel_rank)
            replay_address = self.config.socket_address(replay, "replay ROUTER", binds=True)
            self._replay = self._ctx.socket(zmq.ROUTER)
            # A ROUTER silently drops past its HWM: leave room for one whole replay.
            self._replay.sndhwm = self.config.buffer_steps + 2
            self._replay.ipv6 = "[" in replay_address
            _attach(self._replay, replay_address, True)

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
            while not self._stopping:
                self._serve_replays()
                try:
                    item = self._queue.get(timeout=self.IDLE_WAIT_S)
                except queue.Empty:
                    continue
                self._take(item)
        finally:
            self._close_sockets()

    def _take(self, item: tuple[int, bytes] | None) -> None:
        if item is None:  # close(): everything before it was queued first
            self._stopping = True
        else:
            self._send(*item)

    def _drain(self) -> None:
        """Send the batches already queued: a replay then holds every batch published before
        its request arrived (a test run replayed 0-5 with seq 6 published but still queued)."""
        while not self._stopping:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            self._take(item)

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
            self._drain()
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
