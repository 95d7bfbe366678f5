"""KV-event subscriber over real ZeroMQ sockets: seq tracking, replay, states (oracles 5-7)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import msgpack
import pytest
import zmq
import zmq.asyncio

from adapters.vllm.kv_subscriber import (
    KVEventSubscriber,
    KVSubscriberConfig,
    SeqVerdict,
    SyncState,
    Watermark,
    classify_seq,
)
from tests.adapters.test_vllm_shadow_index import expected_state
from tests.adapters.vllm_vectors import RUNS, kv_recording, plain_decode

END = [b"", b"", b"\xff" * 8, b""]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def batch_frames(seq: int, events: list, ts: float | None = None, rank: int = 0) -> list[bytes]:
    payload = msgpack.packb([float(seq) if ts is None else ts, events, rank])
    return [b"kv", seq.to_bytes(8, "big"), payload]


def store(h: int, parent: int | None = None, salt: str | None = "t") -> dict:
    return {
        "type": "BlockStored",
        "block_hashes": [h],
        "parent_block_hash": parent,
        "token_ids": [1] * 32,
        "block_size": 32,
        "medium": "GPU",
        "extra_keys": [[salt] if salt and parent is None else None],
    }


class FakeVLLMSockets:
    """A real PUB (connecting, like vLLM with tcp://host:P) and a real replay ROUTER.

    The ROUTER answers from `buffer` (PUB-shaped frames) in the ≥ v0.26 reply shape, or
    from `recorded_replies` verbatim, or not at all when `mute`.
    """

    def __init__(self, ctx: zmq.asyncio.Context, sub_port: int, old_shape: bool = False) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.connect(f"tcp://127.0.0.1:{sub_port}")
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.buffer: list[list[bytes]] = []
        self.recorded_replies: list[list[bytes]] | None = None
        self.requests: list[int] = []
        self.mute = False
        self.old_shape = old_shape
        self.task = asyncio.create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            identity, empty, start = await self.router.recv_multipart()
            assert empty == b""
            start_seq = int.from_bytes(start, "big")
            self.requests.append(start_seq)
            if self.mute:
                continue
            for reply in self._replies(start_seq):
                await self.router.send_multipart([identity, *reply])

    def _replies(self, start_seq: int) -> list[list[bytes]]:
        if self.recorded_replies is not None:
            keep = [
                r for r in self.recorded_replies[:-1] if int.from_bytes(r[2], "big") >= start_seq
            ]
            return [*keep, self.recorded_replies[-1]]
        kept = [f for f in self.buffer if int.from_bytes(f[1], "big") >= start_seq]
        if self.old_shape:
            return [*([b"", f[1], f[2]] for f in kept), [b"", b"\xff" * 8, b""]]
        return [*([b"", *f] for f in kept), END]

    async def publish(self, frames: list[bytes], buffer: bool = True) -> None:
        if buffer:
            self.buffer.append(frames)
        await self.pub.send_multipart(frames)

    async def close(self) -> None:
        self.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self.task


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


async def started(ctx, replay: bool = True, old_shape: bool = False, timeout: float = 1.0):
    port = free_port()
    engine = FakeVLLMSockets(ctx, port, old_shape)
    config = KVSubscriberConfig(
        endpoint=f"tcp://127.0.0.1:{port}",
        replay_endpoint=f"tcp://*:{engine.replay_port}" if replay else None,
        topic="kv",
        replay_timeout_s=timeout,
    )
    subscriber = KVEventSubscriber(config)
    await subscriber.start()
    assert await subscriber.wait_connected(5.0)
    await asyncio.sleep(0.3)  # let the subscription reach the PUB side
    return engine, subscriber


def test_classify_seq_oracles() -> None:
    assert classify_seq(None, None, 4, 1.0) is SeqVerdict.FIRST
    assert classify_seq(41, 1.0, 42, 2.0) is SeqVerdict.NEXT
    assert classify_seq(41, 1.0, 44, 2.0) is SeqVerdict.GAP  # oracle 5
    assert classify_seq(900, 1.0, 3, 2.0) is SeqVerdict.RESTART  # oracle 6
    assert classify_seq(7, 1.0, 7, 1.0) is SeqVerdict.DUPLICATE  # oracle 7
    assert classify_seq(0, 1.0, 0, 5.0) is SeqVerdict.RESTART


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS, ids=lambda p: p.name)
async def test_recorded_run_joined_mid_stream_replays_and_ends_exact(ctx, run) -> None:
    recording = kv_recording(run)
    engine, subscriber = await started(ctx)
    engine.recorded_replies = recording["replay_reply_frames"]
    try:
        assert subscriber.state() is SyncState.STALE
        pub = recording["pub_frames"]
        for frames in pub[5:]:
            await engine.publish(frames, buffer=False)
        last_seq, _ = plain_decode(pub[-1])
        assert await subscriber.wait_for_seq(last_seq, timeout_s=10.0)
        assert engine.requests[0] == 0  # joined at seq 5: replayed from 0
        index = subscriber.index(0)
        index.check_integrity()
        resident, salts = expected_state(pub)
        assert index.all_blocks() == resident
        assert index.resident("tenant-a") == {h for h, s in salts.items() if s == "tenant-a"}
        assert subscriber.state() is SyncState.SYNCED
        mark = subscriber.watermark()
        assert (mark.seq, mark.discontinuities) == (last_seq, 0)
        history = subscriber.evidence_since(Watermark(0, 4, SyncState.SYNCED, 0))
        assert history.gap_free and [b.seq for b in history.batches] == list(range(5, last_seq + 1))
        assert all(
            e.token_ids == () for b in history.batches for e in b.events if hasattr(e, "token_ids")
        )
    finally:
        await subscriber.close()
        await engine.close()
    assert subscriber.state() is SyncState.STALE


@pytest.mark.slow
@pytest.mark.parametrize("old_shape", [False, True], ids=["v026-reply", "v025-reply"])
async def test_oracle5_gap_replayed_in_order(ctx, old_shape: bool) -> None:
    engine, subscriber = await started(ctx, old_shape=old_shape)
    try:
        await engine.publish(batch_frames(0, [store(1)]))
        await engine.publish(batch_frames(1, [store(2, parent=1)]))
        engine.buffer.append(batch_frames(2, [store(3, parent=2)]))
        engine.buffer.append(batch_frames(3, [{"type": "BlockRemoved", "block_hashes": [3]}]))
        # seq 2 and 3 reach only the replay buffer: the subscriber sees 0, 1, (2), 4
        await engine.publish(batch_frames(4, [store(5, parent=2)]))
        assert await subscriber.wait_for_seq(4, timeout_s=5.0)
        assert subscriber.index().resident("t") == {1, 2, 5}
        assert subscriber.state() is SyncState.SYNCED
        assert subscriber.watermark().discontinuities == 0
        assert engine.requests == [2]
    finally:
        await subscriber.close()
        await engine.close()


@pytest.mark.slow
async def test_gap_without_replay_is_uncertain_until_cleared(ctx) -> None:
    engine, subscriber = await started(ctx, replay=False)
    try:
        assert not subscriber.settled()  # no batch yet: waiting may bring the first
        await engine.publish(batch_frames(0, [store(1)]))
        assert await subscriber.wait_for_seq(0, timeout_s=5.0)
        assert subscriber.state() is SyncState.SYNCED and subscriber.settled()
        mark = subscriber.watermark()
        await engine.publish(batch_frames(3, [store(7)]))
        assert await subscriber.wait_for_seq(3, timeout_s=5.0)
        assert subscriber.state() is SyncState.UNCERTAIN
        assert subscriber.settled()  # the gap is lost for good: nothing to wait for
        assert not subscriber.evidence_since(mark).gap_free
        await engine.publish(batch_frames(4, [{"type": "AllBlocksCleared"}, store(9)]))
        assert await subscriber.wait_for_seq(4, timeout_s=5.0)
        assert subscriber.state() is SyncState.SYNCED
        assert subscriber.index().all_blocks() == {9}
        after_clear = subscriber.watermark()
        await engine.publish(batch_frames(5, [{"type": "AllBlocksCleared"}]))
        assert await subscriber.wait_for_seq(5, timeout_s=5.0)
        evidence = subscriber.evidence_since(after_clear)
        assert evidence.gap_free and [b.seq for b in evidence.batches] == [5]
    finally:
        await subscriber.close()
        await engine.close()


@pytest.mark.slow
async def test_oracle6_restart_clears_and_oracle7_duplicate_dropped(ctx) -> None:
    engine, subscriber = await started(ctx)
    try:
        first = batch_frames(0, [store(1)], ts=10.0)
        await engine.publish(first)
        await engine.publish(first, buffer=False)  # duplicate (seq, ts)
        await engine.publish(batch_frames(1, [store(2, parent=1)], ts=11.0))
        assert await subscriber.wait_for_seq(1, timeout_s=5.0)
        assert subscriber.index().all_blocks() == {1, 2}
        engine.buffer = []  # the engine restarts: its buffer is new
        await engine.publish(batch_frames(0, [store(8)], ts=20.0))
        for _ in range(50):
            if subscriber.index().all_blocks() == {8}:
                break
            await asyncio.sleep(0.05)
        assert subscriber.index().all_blocks() == {8}
        assert subscriber.state() is SyncState.SYNCED
        assert subscriber.watermark().discontinuities == 1
    finally:
        await subscriber.close()
        await engine.close()


@pytest.mark.slow
async def test_replay_that_never_answers_is_bounded_and_uncertain(ctx) -> None:
    engine, subscriber = await started(ctx, timeout=0.3)
    engine.mute = True
    try:
        await engine.publish(batch_frames(6, [store(1)]))
        assert await subscriber.wait_for_seq(6, timeout_s=3.0)
        assert subscriber.state() is SyncState.UNCERTAIN
        assert subscriber.index().resident("t") == {1}
        assert not await subscriber.probe_replay()
    finally:
        await subscriber.close()
        await engine.close()


@pytest.mark.slow
async def test_connects_when_vllm_binds_a_wildcard(ctx) -> None:
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    replay_port = router.bind_to_random_port("tcp://127.0.0.1")
    subscriber = KVEventSubscriber(
        KVSubscriberConfig(endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{replay_port}")
    )
    await subscriber.start()
    try:
        assert await subscriber.wait_connected(5.0)
        probe = asyncio.create_task(subscriber.probe_replay())
        identity, _, start = await router.recv_multipart()
        assert int.from_bytes(start, "big") == 2**63 - 1
        await router.send_multipart([identity, *END])
        assert await probe
    finally:
        await subscriber.close()


@pytest.mark.slow
async def test_undecodable_message_marks_uncertain(ctx) -> None:
    engine, subscriber = await started(ctx, replay=False)
    try:
        await engine.publish(batch_frames(0, [store(1)]))
        assert await subscriber.wait_for_seq(0, timeout_s=5.0)
        await engine.pub.send_multipart([b"kv", (1).to_bytes(8, "big"), b"\xc1garbage"])
        await engine.publish(batch_frames(2, [store(2)]))
        assert await subscriber.wait_for_seq(2, timeout_s=5.0)
        assert subscriber.decode_errors == 1
        assert subscriber.state() is SyncState.UNCERTAIN
    finally:
        await subscriber.close()
        await engine.close()


@pytest.mark.slow
async def test_engine_restarted_while_disconnected_is_detected_through_replay(ctx) -> None:
    engine, subscriber = await started(ctx)
    try:
        await engine.publish(batch_frames(0, [store(1)], ts=1.0))
        assert await subscriber.wait_for_seq(0, timeout_s=5.0)
        assert subscriber.state() is SyncState.SYNCED
        engine.pub.close(linger=0)  # the engine process goes away
        for _ in range(100):
            if subscriber.state() is SyncState.STALE:
                break
            await asyncio.sleep(0.05)
        assert subscriber.state() is SyncState.STALE
        # A new engine: its seq 0 (ts 100) was published before we reconnected.
        engine.buffer = [batch_frames(0, [store(5)], ts=100.0)]
        engine.pub = ctx.socket(zmq.PUB)
        engine.pub.setsockopt(zmq.LINGER, 0)
        engine.pub.connect(subscriber.config.endpoint)
        await asyncio.sleep(0.5)
        await engine.publish(batch_frames(1, [store(6, parent=5)], ts=101.0))
        assert await subscriber.wait_for_seq(1, timeout_s=5.0)
        assert subscriber.index().all_blocks() == {5, 6}  # block 1 died with the old engine
        assert subscriber.state() is SyncState.SYNCED
        assert subscriber.watermark().discontinuities == 1
    finally:
        await subscriber.close()
        await engine.close()
