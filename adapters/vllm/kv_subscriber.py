"""Asyncio ZeroMQ subscriber for vLLM KV-cache events (docs/design.md §5,
docs/reference/vllm-surfaces.md §2).

One subscriber follows one engine: its `data_parallel_size` ranks publish on the endpoint
with vLLM's port offset (rank r on port + r, replay ROUTER likewise), all read by one SUB
socket; `seq` is tracked per rank (the rank comes from each batch) and every rank has its own
bounded ShadowIndex. A batch naming a rank outside 0..N-1 is dropped and counted
(`foreign_rank_batches`): only configured ranks exist. Per rank:

- first batch seq 0, or replay filled 0..seq-1: SYNCED; otherwise UNCERTAIN;
- seq = last+1 applies; seq > last+1 replays the gap through the ROUTER with a DEALER
  (bounded by `replay_timeout_s`); an unfilled gap makes the rank UNCERTAIN;
- seq < last, or seq = last with another ts, is an engine restart: the index is cleared and
  the rank starts over as on its first batch; an identical (seq, ts) is a duplicate, dropped;
- after the publisher's connection drops, the rank is STALE until its next batch, which is
  checked against the replay buffer (same ts at our last seq = same engine, otherwise a
  restart); without replay a reconnect is an unrecoverable gap;
- an `AllBlocksCleared` for every medium makes an UNCERTAIN rank SYNCED again, since nothing
  before it matters;
- a store the bounded index had to drop (more blocks than the engine has) makes the rank
  UNCERTAIN: memory stays bounded and the index no longer claims to mirror the engine.

SEC-17: no socket leaves loopback unless `allow_remote` (adapters/vllm/kv_endpoints.py);
messages over `max_message_bytes` are refused by ZeroMQ; the kept history holds neither
token ids nor extra keys (where the salts are), and is bounded in events; namespaces are
digests under the namespace key.

So the state never claims SYNCED after an unreplayed gap. Each loss bumps `discontinuities`,
which a `Watermark` captures so a verifier can ask for gap-free evidence after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Literal

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from policies.kv_sockets import offset_endpoint_port
from schemas.kv_events import AllBlocksCleared, BlockStored, KVEventBatch
from schemas.values import is_int

from .capabilities import CapabilityRefusedError
from .kv_decode import KVDecodeError, decode_message, decode_replay_reply
from .kv_endpoints import local_dial, local_side
from .shadow_index import DEFAULT_CAPACITY, ShadowIndex

log = logging.getLogger(__name__)

PROBE_START_SEQ = (1 << 63) - 1  # above any buffered seq: the ROUTER answers the end marker only


class KVEndpointError(CapabilityRefusedError):
    """A configured KV-event endpoint could not be bound or dialled (a port in use, a bad
    address): the events the isolation evidence rests on cannot arrive, so start-up is
    refused in one line."""


class SyncState(enum.StrEnum):
    SYNCED = "synced"
    UNCERTAIN = "uncertain"
    STALE = "stale"


class SeqVerdict(enum.StrEnum):
    FIRST = "first"
    NEXT = "next"
    GAP = "gap"
    DUPLICATE = "duplicate"
    RESTART = "restart"


def classify_seq(last_seq: int | None, last_ts: float | None, seq: int, ts: float) -> SeqVerdict:
    """How a live batch relates to the last one applied (oracle cases 5-7)."""
    if last_seq is None:
        return SeqVerdict.FIRST
    if seq == last_seq + 1:
        return SeqVerdict.NEXT
    if seq > last_seq + 1:
        return SeqVerdict.GAP
    if seq == last_seq and ts == last_ts:
        return SeqVerdict.DUPLICATE
    return SeqVerdict.RESTART


@dataclass(frozen=True, slots=True)
class KVSubscriberConfig:
    """`endpoint` / `replay_endpoint` as written in vLLM's --kv-events-config (rank 0's).

    `mode` "auto" derives bind/connect from the endpoint form; `connect_host` replaces a
    wildcard host when dialling; `allow_remote` permits sockets off loopback (SEC-17).
    `data_parallel_size` ranks are followed; `max_blocks_per_rank` bounds each rank's index
    until the engine's block count is known (`set_block_capacity`); the kept history holds
    at most `history_batches` batches and `history_max_events` events.
    """

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    connect_host: str = "127.0.0.1"
    mode: Literal["auto", "bind", "connect"] = "auto"
    allow_remote: bool = False
    data_parallel_size: int = 1
    replay_timeout_s: float = 2.0
    replay_max_batches: int = 100_000
    history_batches: int = 4096
    history_max_events: int = 1 << 16
    max_blocks_per_rank: int = DEFAULT_CAPACITY
    max_message_bytes: int = 16 << 20
    receive_hwm: int = 100_000

    def __post_init__(self) -> None:
        for name in ("data_parallel_size", "replay_max_batches", "history_batches",
                     "history_max_events", "max_blocks_per_rank", "max_message_bytes"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.replay_timeout_s <= 0:
            raise ValueError("replay_timeout_s must be positive")
        for rank in range(self.data_parallel_size):
            self.sub_side(rank)
            self.replay_address(rank)

    def sub_side(self, rank: int) -> tuple[str, str]:
        """(bind or connect, address) of the SUB socket for one rank's publisher."""
        endpoint = offset_endpoint_port(self.endpoint, rank)
        return local_side(endpoint, self.mode, self.connect_host, self.allow_remote)

    def replay_address(self, rank: int) -> str | None:
        if self.replay_endpoint is None:
            return None
        endpoint = offset_endpoint_port(self.replay_endpoint, rank)
        return local_dial(endpoint, self.connect_host, self.allow_remote)


@dataclass(frozen=True, slots=True)
class Watermark:
    """Where a rank stood: last applied seq, its state, and losses so far."""

    dp_rank: int
    seq: int | None
    state: SyncState
    discontinuities: int


@dataclass(frozen=True, slots=True)
class KVEvidence:
    """Batches applied after a watermark (token ids stripped) and whether none were lost."""

    gap_free: bool
    batches: tuple[KVEventBatch, ...]


@dataclass
class _Rank:
    index: ShadowIndex
    last_seq: int | None = None
    last_ts: float | None = None
    continuity: SyncState = SyncState.UNCERTAIN
    awaiting_resume: bool = True
    discontinuities: int = 0
    restarts: int = 0
    duplicates: int = 0
    history: deque[KVEventBatch] = field(default_factory=deque)
    history_events: int = 0


def _without_prompt_data(batch: KVEventBatch) -> KVEventBatch:
    """The batch as kept in history: no token ids, no extra keys (they carry the salt)."""
    events = tuple(
        replace(e, token_ids=(), extra_keys=None) if isinstance(e, BlockStored) else e
        for e in batch.events
    )
    return replace(batch, events=events)


class KVEventSubscriber:
    """Follows one publisher; `start()` opens the sockets, `close()` releases them."""

    def __init__(self, config: KVSubscriberConfig, namespace_key: bytes | None = None) -> None:
        self.config = config
        self._namespace_key = namespace_key
        self._capacity = config.max_blocks_per_rank
        self._ctx = zmq.asyncio.Context()
        self._ranks = {r: self._new_rank() for r in range(config.data_parallel_size)}
        self._tasks: list[asyncio.Task[None]] = []
        self._sub: zmq.asyncio.Socket | None = None
        self._endpoint_rank: dict[str, int] = {}
        self._connected: set[int] = set()
        self._connection_change = asyncio.Event()
        self._progress = asyncio.Event()
        self.decode_errors = 0
        self.foreign_rank_batches = 0

    @property
    def has_replay(self) -> bool:
        return self.config.replay_endpoint is not None

    async def start(self) -> None:
        if self._sub is not None:
            return
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, self.config.receive_hwm)
        sub.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)
        sub.setsockopt(zmq.SUBSCRIBE, self.config.topic.encode())
        if ":" in self.config.connect_host:
            sub.setsockopt(zmq.IPV6, 1)
        monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        for rank in self._ranks:
            side, address = self.config.sub_side(rank)
            try:
                if side == "bind":
                    sub.bind(address)
                else:
                    sub.connect(address)
            except zmq.ZMQError as exc:
                sub.disable_monitor()
                monitor.close(linger=0)
                sub.close(linger=0)
                reason = zmq.strerror(exc.errno) if exc.errno else str(exc)
                raise KVEndpointError(f"KV events: cannot {side} {address}: {reason}") from None
            self._endpoint_rank[sub.getsockopt_string(zmq.LAST_ENDPOINT)] = rank
            self._endpoint_rank[address] = rank
        self._sub = sub
        self._tasks = [
            asyncio.create_task(self._receive_loop(sub)),
            asyncio.create_task(self._monitor_loop(monitor)),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        if self._sub is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sub.disable_monitor()
            self._sub = None
        self._ctx.destroy(linger=0)
        self._connected.clear()

    def set_block_capacity(self, blocks: int) -> None:
        """Bound every rank's index by the engine's block count (from its cache config)."""
        self._capacity = min(blocks, self.config.max_blocks_per_rank)
        for rank in self._ranks.values():
            rank.index.set_capacity(self._capacity)
            if len(rank.index) > self._capacity:
                self._mark_gap(rank)

    def _new_rank(self) -> _Rank:
        return _Rank(index=ShadowIndex(self._capacity, self._namespace_key),
                     history=deque(maxlen=self.config.history_batches))

    # --- state for the rest of fak -------------------------------------------------------

    def ranks(self) -> tuple[int, ...]:
        """The configured ranks, 0..data_parallel_size-1."""
        return tuple(self._ranks)

    def restarts(self, dp_rank: int = 0) -> int:
        """Engine restarts seen on the rank (a seq that went back)."""
        return self._rank(dp_rank).restarts

    def index(self, dp_rank: int = 0) -> ShadowIndex:
        return self._rank(dp_rank).index

    def state(self, dp_rank: int = 0) -> SyncState:
        rank = self._rank(dp_rank)
        running = bool(self._tasks) and not any(map(asyncio.Task.done, self._tasks))
        if not running or rank.awaiting_resume:
            return SyncState.STALE
        return rank.continuity

    def settled(self, dp_rank: int = 0) -> bool:
        """Whether waiting can no longer change the rank's state: SYNCED, or UNCERTAIN once
        it has applied batches (what it lost is lost for good; only an engine-wide clear
        resyncs it). Not while STALE or before its first batch, which a wait may bring."""
        state = self.state(dp_rank)
        return state is SyncState.SYNCED or (
            state is SyncState.UNCERTAIN and self._rank(dp_rank).last_seq is not None)

    def watermark(self, dp_rank: int = 0) -> Watermark:
        rank = self._rank(dp_rank)
        return Watermark(dp_rank, rank.last_seq, self.state(dp_rank), rank.discontinuities)

    def evidence_since(self, mark: Watermark) -> KVEvidence:
        """Batches applied after `mark`; gap_free only if nothing was lost in between."""
        rank = self._rank(mark.dp_rank)
        after = tuple(b for b in rank.history if mark.seq is None or b.seq > mark.seq)
        expected_first = 0 if mark.seq is None else mark.seq + 1
        covered = after[0].seq == expected_first if after else rank.last_seq == mark.seq
        gap_free = (
            covered
            and mark.state is SyncState.SYNCED
            and self.state(mark.dp_rank) is SyncState.SYNCED
            and rank.discontinuities == mark.discontinuities
        )
        return KVEvidence(gap_free=gap_free, batches=after)

    async def wait_for_seq(self, seq: int, dp_rank: int = 0, timeout_s: float = 5.0) -> bool:
        """True once events up to `seq` (or later) are applied for the rank; False on timeout."""
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    rank = self._ranks.get(dp_rank)
                    if rank is not None and rank.last_seq is not None and rank.last_seq >= seq:
                        return True
                    await self._progress.wait()
        except TimeoutError:
            return False

    async def wait_connected(self, timeout_s: float) -> bool:
        """True once every rank's publisher completed the ZMTP handshake with our SUB."""
        try:
            async with asyncio.timeout(timeout_s):
                while len(self._connected) < len(self._ranks):
                    await self._connection_change.wait()
            return True
        except TimeoutError:
            return False

    async def probe_replay(self) -> bool:
        """True when every rank's replay ROUTER answers (an end marker for a seq beyond
        its buffer)."""
        for rank in self._ranks:
            _, complete = await self.replay(PROBE_START_SEQ, rank)
            if not complete:
                return False
        return True

    # --- replay --------------------------------------------------------------------------

    async def replay(self, start_seq: int, dp_rank: int = 0) -> tuple[list[KVEventBatch], bool]:
        """The rank's buffered batches with seq ≥ start_seq, and whether the end marker
        arrived in time."""
        address = self.config.replay_address(dp_rank)
        if address is None:
            return [], False
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)
        if ":" in self.config.connect_host:
            dealer.setsockopt(zmq.IPV6, 1)
        dealer.connect(address)
        batches: list[KVEventBatch] = []
        try:
            async with asyncio.timeout(self.config.replay_timeout_s):
                # A DEALER must add the empty delimiter a REQ socket would (§2.3).
                await dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
                while len(batches) < self.config.replay_max_batches:
                    batch = decode_replay_reply(await dealer.recv_multipart())
                    if batch is None:
                        return batches, True
                    batches.append(batch)
        except (TimeoutError, KVDecodeError) as exc:
            log.warning("KV replay from seq %d incomplete: %r", start_seq, exc)
        finally:
            dealer.close(linger=0)
        return batches, False

    # --- loops ---------------------------------------------------------------------------

    async def _receive_loop(self, sub: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sub.recv_multipart()
            try:
                batch = decode_message(frames)
            except KVDecodeError as exc:
                self.decode_errors += 1
                log.warning("undecodable KV event message: %s", exc)
                for rank in self._ranks.values():
                    self._mark_gap(rank)
                continue
            await self._on_batch(batch)

    async def _monitor_loop(self, monitor: zmq.asyncio.Socket) -> None:
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                endpoint = event.get("endpoint", b"")
                rank = self._endpoint_rank.get(
                    endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint))
                ranks = tuple(self._ranks) if rank is None else (rank,)
                if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self._connected.update(ranks)
                elif event["event"] == zmq.EVENT_DISCONNECTED:
                    self._connected.difference_update(ranks)
                    for r in ranks:
                        self._ranks[r].awaiting_resume = True
                self._connection_change.set()
                self._connection_change = asyncio.Event()
        finally:
            monitor.close(linger=0)

    # --- sequence handling ---------------------------------------------------------------

    def _rank(self, dp_rank: int) -> _Rank:
        rank = self._ranks.get(dp_rank)
        if rank is None:
            raise KeyError(f"rank {dp_rank} is not configured (data_parallel_size "
                           f"{self.config.data_parallel_size})")
        return rank

    async def _on_batch(self, batch: KVEventBatch) -> None:
        rank = self._ranks.get(batch.dp_rank)
        if rank is None:
            self.foreign_rank_batches += 1
            if self.foreign_rank_batches in (1, 10, 100) or self.foreign_rank_batches % 1000 == 0:
                log.warning("dropped %d KV batches naming unconfigured ranks",
                            self.foreign_rank_batches)
            return
        if (
            rank.awaiting_resume
            and rank.last_seq is not None
            and await self._restarted_while_away(rank, batch.dp_rank)
        ):
            self._restart(rank)
        verdict = classify_seq(rank.last_seq, rank.last_ts, batch.seq, batch.ts)
        if verdict is SeqVerdict.DUPLICATE:
            rank.duplicates += 1
            return
        if verdict is SeqVerdict.RESTART:
            self._restart(rank)
            verdict = SeqVerdict.FIRST
        if verdict is SeqVerdict.FIRST:
            rank.continuity = SyncState.SYNCED
            await self._fill(rank, 0, batch.seq, batch.dp_rank)
        elif verdict is SeqVerdict.GAP:
            assert rank.last_seq is not None
            await self._fill(rank, rank.last_seq + 1, batch.seq, batch.dp_rank)
        self._apply(rank, batch)

    async def _restarted_while_away(self, rank: _Rank, dp_rank: int) -> bool:
        """After a disconnect: is the publisher still the engine whose last batch we hold?"""
        assert rank.last_seq is not None
        if not self.has_replay:
            self._mark_gap(rank)  # cannot tell what was missed while away
            return False
        batches, _ = await self.replay(rank.last_seq, dp_rank)
        same = bool(batches) and batches[0].seq == rank.last_seq and batches[0].ts == rank.last_ts
        return not same

    async def _fill(self, rank: _Rank, start: int, stop: int, dp_rank: int) -> None:
        """Apply replayed batches start..stop-1; any seq not obtained is a gap."""
        if start >= stop:
            return
        replayed, _ = await self.replay(start, dp_rank)
        expected = start
        for batch in replayed:
            if batch.dp_rank != dp_rank or not expected <= batch.seq < stop:
                continue
            if batch.seq != expected:
                self._mark_gap(rank)
            self._apply(rank, batch)
            expected = batch.seq + 1
        if expected != stop:
            self._mark_gap(rank)

    def _restart(self, rank: _Rank) -> None:
        log.warning("KV event seq went back: engine restart, index cleared")
        rank.index.clear()
        rank.last_seq = rank.last_ts = None
        rank.restarts += 1
        rank.discontinuities += 1

    def _mark_gap(self, rank: _Rank) -> None:
        rank.continuity = SyncState.UNCERTAIN
        rank.discontinuities += 1

    def _apply(self, rank: _Rank, batch: KVEventBatch) -> None:
        for event in batch.events:
            dropped = rank.index.overflow_drops
            rank.index.apply(event)
            if isinstance(event, AllBlocksCleared) and event.medium is None:
                rank.continuity = SyncState.SYNCED
            elif rank.index.overflow_drops > dropped:
                if rank.continuity is not SyncState.UNCERTAIN:
                    log.warning("KV index full (%d blocks): rank uncertain", rank.index.capacity)
                self._mark_gap(rank)
        rank.last_seq, rank.last_ts = batch.seq, batch.ts
        rank.awaiting_resume = False
        self._remember(rank, _without_prompt_data(batch))
        self._progress.set()
        self._progress = asyncio.Event()

    def _remember(self, rank: _Rank, batch: KVEventBatch) -> None:
        """Keep the batch in the bounded history (oldest batches leave first)."""
        if len(rank.history) == rank.history.maxlen:
            rank.history_events -= len(rank.history[0].events)
        rank.history.append(batch)
        rank.history_events += len(batch.events)
        while rank.history_events > self.config.history_max_events and len(rank.history) > 1:
            rank.history_events -= len(rank.history.popleft().events)
