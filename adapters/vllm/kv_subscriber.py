"""Asyncio ZeroMQ subscriber for vLLM KV-cache events (docs/design.md §5,
docs/reference/vllm-surfaces.md §2).

One subscriber follows one vLLM publisher endpoint; `seq` is tracked per DP rank (the rank
comes from each batch) and every rank has its own ShadowIndex. Per rank:

- first batch seq 0, or replay filled 0..seq-1: SYNCED; otherwise UNCERTAIN;
- seq = last+1 applies; seq > last+1 replays the gap through the ROUTER with a DEALER
  (bounded by `replay_timeout_s`); an unfilled gap makes the rank UNCERTAIN;
- seq < last, or seq = last with another ts, is an engine restart: the index is cleared and
  the rank starts over as on its first batch; an identical (seq, ts) is a duplicate, dropped;
- after the publisher's connection drops, the rank is STALE until its next batch, which is
  checked against the replay buffer (same ts at our last seq = same engine, otherwise a
  restart); without replay a reconnect is an unrecoverable gap;
- an `AllBlocksCleared` for every medium makes an UNCERTAIN rank SYNCED again, since nothing
  before it matters.

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

from schemas.kv_events import AllBlocksCleared, BlockStored, KVEventBatch

from .kv_decode import KVDecodeError, decode_message, decode_replay_reply
from .kv_endpoints import dial_address, subscriber_side
from .shadow_index import ShadowIndex

log = logging.getLogger(__name__)

PROBE_START_SEQ = (1 << 63) - 1  # above any buffered seq: the ROUTER answers the end marker only


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
    """`endpoint` / `replay_endpoint` as written in vLLM's --kv-events-config.

    `mode` "auto" derives bind/connect from the endpoint form; `connect_host` replaces a
    wildcard host when dialling.
    """

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    connect_host: str = "127.0.0.1"
    mode: Literal["auto", "bind", "connect"] = "auto"
    replay_timeout_s: float = 2.0
    replay_max_batches: int = 100_000
    history_batches: int = 4096
    receive_hwm: int = 100_000

    def __post_init__(self) -> None:
        subscriber_side(self.endpoint, self.mode, self.connect_host)
        if self.replay_endpoint is not None:
            dial_address(self.replay_endpoint, self.connect_host)
        if self.replay_timeout_s <= 0 or self.replay_max_batches <= 0 or self.history_batches <= 0:
            raise ValueError(
                "replay_timeout_s, replay_max_batches and history_batches must be positive"
            )


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
    index: ShadowIndex = field(default_factory=ShadowIndex)
    last_seq: int | None = None
    last_ts: float | None = None
    continuity: SyncState = SyncState.UNCERTAIN
    awaiting_resume: bool = True
    discontinuities: int = 0
    restarts: int = 0
    duplicates: int = 0
    history: deque[KVEventBatch] = field(default_factory=deque)


def _without_tokens(batch: KVEventBatch) -> KVEventBatch:
    events = tuple(
        replace(e, token_ids=()) if isinstance(e, BlockStored) else e for e in batch.events
    )
    return replace(batch, events=events)


class KVEventSubscriber:
    """Follows one publisher; `start()` opens the sockets, `close()` releases them."""

    def __init__(self, config: KVSubscriberConfig) -> None:
        self.config = config
        self._ctx = zmq.asyncio.Context()
        self._ranks: dict[int, _Rank] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._sub: zmq.asyncio.Socket | None = None
        self._connected = asyncio.Event()
        self._progress = asyncio.Event()
        self.decode_errors = 0

    @property
    def has_replay(self) -> bool:
        return self.config.replay_endpoint is not None

    async def start(self) -> None:
        if self._sub is not None:
            return
        side, address = subscriber_side(
            self.config.endpoint, self.config.mode, self.config.connect_host
        )
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, self.config.receive_hwm)
        sub.setsockopt(zmq.SUBSCRIBE, self.config.topic.encode())
        if ":" in self.config.connect_host:
            sub.setsockopt(zmq.IPV6, 1)
        monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        if side == "bind":
            sub.bind(address)
        else:
            sub.connect(address)
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

    # --- state for the rest of fak -------------------------------------------------------

    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted(self._ranks))

    def index(self, dp_rank: int = 0) -> ShadowIndex:
        return self._rank(dp_rank).index

    def state(self, dp_rank: int = 0) -> SyncState:
        rank = self._ranks.get(dp_rank)
        running = bool(self._tasks) and not any(t.done() for t in self._tasks)
        if rank is None or not running or rank.awaiting_resume:
            return SyncState.STALE
        return rank.continuity

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
        """True once a publisher completed the ZMTP handshake with our SUB socket."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._connected.wait()
            return True
        except TimeoutError:
            return False

    async def probe_replay(self) -> bool:
        """True when the replay ROUTER answers (an end marker for a seq beyond its buffer)."""
        _, complete = await self.replay(PROBE_START_SEQ)
        return complete

    # --- replay --------------------------------------------------------------------------

    async def replay(self, start_seq: int) -> tuple[list[KVEventBatch], bool]:
        """Buffered batches with seq ≥ start_seq, and whether the end marker arrived in time."""
        if self.config.replay_endpoint is None:
            return [], False
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        if ":" in self.config.connect_host:
            dealer.setsockopt(zmq.IPV6, 1)
        dealer.connect(dial_address(self.config.replay_endpoint, self.config.connect_host))
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
                if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self._connected.set()
                elif event["event"] == zmq.EVENT_DISCONNECTED:
                    self._connected.clear()
                    for rank in self._ranks.values():
                        rank.awaiting_resume = True
        finally:
            monitor.close(linger=0)

    # --- sequence handling ---------------------------------------------------------------

    def _rank(self, dp_rank: int) -> _Rank:
        if dp_rank not in self._ranks:
            self._ranks[dp_rank] = _Rank(history=deque(maxlen=self.config.history_batches))
        return self._ranks[dp_rank]

    async def _on_batch(self, batch: KVEventBatch) -> None:
        rank = self._rank(batch.dp_rank)
        if (
            rank.awaiting_resume
            and rank.last_seq is not None
            and await self._restarted_while_away(rank)
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

    async def _restarted_while_away(self, rank: _Rank) -> bool:
        """After a disconnect: is the publisher still the engine whose last batch we hold?"""
        assert rank.last_seq is not None
        if not self.has_replay:
            self._mark_gap(rank)  # cannot tell what was missed while away
            return False
        batches, _ = await self.replay(rank.last_seq)
        same = bool(batches) and batches[0].seq == rank.last_seq and batches[0].ts == rank.last_ts
        return not same

    async def _fill(self, rank: _Rank, start: int, stop: int, dp_rank: int) -> None:
        """Apply replayed batches start..stop-1; any seq not obtained is a gap."""
        if start >= stop:
            return
        replayed, _ = await self.replay(start)
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
            rank.index.apply(event)
            if isinstance(event, AllBlocksCleared) and event.medium is None:
                rank.continuity = SyncState.SYNCED
        rank.last_seq, rank.last_ts = batch.seq, batch.ts
        rank.awaiting_resume = False
        rank.history.append(_without_tokens(batch))
        self._progress.set()
        self._progress = asyncio.Event()
