"""The native engine's KV-event publisher against vLLM 0.32.0's recorded wire, over real ZeroMQ
sockets on loopback: framing, seq, bind/connect, replay, map and legacy layouts, int and bytes
hashes, the sha256_cbor hash chain, and the RadixCache listener feeding a real subscriber."""

from __future__ import annotations

import base64
import json
import socket
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from zmq.utils.monitor import recv_monitor_message

from adapters.vllm.kv_decode import decode_message, decode_replay_reply, fold_hash
from adapters.vllm.shadow_index import ShadowIndex
from native_engine.kvcache.block_hash import (
    NONE_HASH,
    block_hash,
    chain_digests,
    hash_to_wire,
    none_hash,
    prompt_digests,
    sha256_cbor,
)
from native_engine.kvcache.block_pool import BlockPool
from native_engine.kvcache.events import KVEventRecorder, NullEventPublisher
from native_engine.kvcache.radix_cache import RadixCache
from native_engine.serve.kv_config import KVEventsConfig, endpoint_binds
from native_engine.serve.kv_publisher import (
    PublisherSocketError,
    ZmqEventPublisher,
    make_publisher,
)
from native_engine.serve.kv_wire import END_SEQ, encode_batch, encode_event
from policies.kv_sockets import offset_endpoint_port
from schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

VECTORS = Path(__file__).resolve().parents[3] / "shared" / "vectors"
INT_RUN = VECTORS / "vllm-0.32.0-cpu" / "kv_frames.json"
BYTES_RUN = VECTORS / "vllm-0.32.0-cpu-bytes-hashes-bs32" / "kv_frames.json"
RECV_TIMEOUT_MS = 5000


def recorded(path: Path, key: str) -> list[list[bytes]]:
    """Recorded messages (`pub_frames` or `replay_reply_frames`) as lists of frames."""
    raw = json.loads(path.read_text())[key]
    return [[base64.b64decode(f) for f in msg] for msg in raw]


def records_from_payload(payload: bytes) -> tuple[float, list[KVEvent], int]:
    """The recorded map events as schema records, values untouched (hashes as sent)."""
    ts, events, rank = msgpack.unpackb(payload, raw=False)
    out: list[KVEvent] = []
    for e in events:
        fields = {k: v for k, v in e.items() if k != "type"}
        if e["type"] == "BlockStored":
            keys = fields["extra_keys"]
            fields["extra_keys"] = tuple(None if k is None else tuple(k) for k in keys)
            out.append(BlockStored(**fields))
        elif e["type"] == "BlockRemoved":
            out.append(BlockRemoved(**fields))
        else:
            out.append(AllBlocksCleared(**fields))
    return ts, out, rank


def stored(salt: str | None = "tenant-a", blocks: int = 2, bs: int = 4) -> BlockStored:
    tokens = list(range(100, 100 + blocks * bs))
    digests = prompt_digests(salt, tokens, bs)
    keys = tuple([(salt,) if salt else None] + [None] * (blocks - 1))
    return BlockStored(
        tuple(digests), None, tuple(tokens), bs, None, "GPU", None, keys, 0, "full_attention"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Subscriber:
    """A SUB socket that knows when its peer handshake finished (no slow-joiner guessing)."""

    def __init__(self, ctx: zmq.Context, topic: bytes = b"") -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.rcvtimeo = RECV_TIMEOUT_MS
        self.sock.subscribe(topic)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)

    def wait_connected(self) -> None:
        assert self.monitor.poll(RECV_TIMEOUT_MS), "no ZMTP handshake with the publisher"
        recv_monitor_message(self.monitor)
        # A bound SUB attaches the new peer (and sends it the subscription) only when its own
        # thread next touches the socket; then the PUB needs a moment to read it.
        self.sock.poll(50)
        time.sleep(0.2)

    def recv(self) -> list[bytes]:
        return self.sock.recv_multipart()

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)


@pytest.fixture
def ctx() -> Any:
    context = zmq.Context()
    yield context
    context.term()


def replay(ctx: zmq.Context, address: str, start: int) -> list[list[bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.rcvtimeo = RECV_TIMEOUT_MS
    dealer.connect(address)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        replies = []
        while True:
            frames = dealer.recv_multipart()
            replies.append(frames)
            if frames[2] == END_SEQ:
                return replies
    finally:
        dealer.close(linger=0)


# -- configuration ------------------------------------------------------------------------


def test_config_defaults_are_vllms_and_json_flag_parses() -> None:
    cfg = KVEventsConfig()
    assert (cfg.endpoint, cfg.replay_endpoint, cfg.buffer_steps, cfg.hwm) == (
        "tcp://*:5557",
        None,
        10_000,
        100_000,
    )
    assert (cfg.max_queue_size, cfg.topic, cfg.publisher, cfg.active) == (
        100_000,
        "",
        "null",
        False,
    )
    cfg = KVEventsConfig.from_json(
        '{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:5557",'
        ' "replay_endpoint": "tcp://*:5558", "topic": "kv", "int_block_hashes": false}'
    )
    assert cfg.publisher == "zmq" and cfg.active and not cfg.int_block_hashes
    assert KVEventsConfig(enable_kv_cache_events=True, publisher="null").active is False


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}', "endpont"),
        ("[1]", "JSON object"),
        ("{nope", "not valid JSON"),
        ('{"publisher": "kafka"}', "publisher"),
        ('{"buffer_steps": -1}', "buffer_steps"),
        ('{"hwm": true}', "hwm"),
        ('{"max_queue_size": 0}', "max_queue_size"),
        ('{"endpoint": "localhost:5557"}', "endpoint"),
        ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events"),
        ('{"topic": 3}', "topic"),
    ],
)
def test_config_rejects_bad_input_clearly(text: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        KVEventsConfig.from_json(text)


def test_bind_or_connect_rule_and_dp_offsets() -> None:
    assert endpoint_binds("tcp://*:5557") and endpoint_binds("tcp://[::]:5557")
    assert endpoint_binds("ipc:///tmp/kv") and endpoint_binds("inproc://kv")
    assert not endpoint_binds("tcp://127.0.0.1:5557")
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint_port("inproc://kv", 1) == "inproc://kv_dp1"
    with pytest.raises(ValueError, match="inproc' or 'tcp"):
        offset_endpoint_port("ipc:///tmp/kv", 1)


def test_make_publisher_follows_vllms_rule() -> None:
    assert isinstance(make_publisher(KVEventsConfig()), NullEventPublisher)
    null = make_publisher(KVEventsConfig(enable_kv_cache_events=True, publisher="null"))
    assert isinstance(null, NullEventPublisher) and null.publish([stored()]) is None


# -- the wire format ----------------------------------------------------------------------


@pytest.mark.parametrize(("path", "int_mode"), [(INT_RUN, True), (BYTES_RUN, False)])
def test_encoding_reproduces_vllm_0_32_payloads_byte_for_byte(path: Path, int_mode: bool) -> None:
    messages = recorded(path, "pub_frames")
    for _, _, payload in messages:
        ts, events, rank = records_from_payload(payload)
        assert encode_batch(ts, events, rank, int_block_hashes=int_mode) == payload
    assert {t for t, _, _ in messages} == {b"kv"}


def test_recorder_events_have_vllms_map_keys_and_value_types() -> None:
    want: dict[str, dict[str, type]] = {}
    for _, _, payload in recorded(INT_RUN, "pub_frames"):
        for e in msgpack.unpackb(payload, raw=False)[1]:
            want[e["type"]] = {k: type(v) for k, v in e.items()}
    assert set(want) == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    pub = CollectingPublisher()
    cache = RadixCache(BlockPool(8, 4), KVEventRecorder(pub))
    fill(cache, "tenant-a", list(range(8)))
    cache.evict(2)
    cache.reset()
    assert isinstance(cache.listener, KVEventRecorder)
    cache.listener.flush()
    got = {}
    for event in pub.batches[0]:
        e = encode_event(event)
        assert isinstance(e, dict)
        assert list(e) == list(want[e["type"]])  # same keys, same order
        got[e["type"]] = {k: type(v) for k, v in e.items()}
    assert got == want


def test_legacy_array_format_is_the_s3_positional_layout() -> None:
    s = stored()
    arr = encode_event(s, legacy_array_format=True)
    assert isinstance(arr, list) and len(arr) == 12
    assert arr[0] == "BlockStored" and arr[1] == [hash_to_wire(h) for h in s.block_hashes]
    assert arr[2] is None and arr[3] == list(s.token_ids) and arr[4] == 4
    assert arr[5:12] == [None, "GPU", None, [("tenant-a",), None], 0, "full_attention", None]
    removed = encode_event(BlockRemoved((s.block_hashes[0],), "GPU", 0), legacy_array_format=True)
    assert removed == ["BlockRemoved", [hash_to_wire(s.block_hashes[0])], "GPU", 0]
    assert encode_event(AllBlocksCleared(), legacy_array_format=True) == ["AllBlocksCleared"]
    batch = msgpack.unpackb(encode_batch(1.5, [s], 3, legacy_array_format=True), raw=False)
    assert batch[0] == 1.5 and batch[2] == 3 and batch[1][0][0] == "BlockStored"


def test_hash_modes_fold_like_vllm_and_bad_hashes_are_refused() -> None:
    s = stored()
    as_int = encode_event(s)
    as_bytes = encode_event(s, int_block_hashes=False)
    assert isinstance(as_int, dict) and isinstance(as_bytes, dict)
    assert all(isinstance(h, bytes) and len(h) == 32 for h in as_bytes["block_hashes"])
    assert as_int["block_hashes"] == [fold_hash(h) for h in as_bytes["block_hashes"]]
    assert as_int["block_hashes"] == [
        int.from_bytes(h, "big") & (2**64 - 1) for h in as_bytes["block_hashes"]
    ]
    with pytest.raises(ValueError, match="needs digests"):
        encode_event(BlockRemoved((5,)), int_block_hashes=False)
    with pytest.raises(ValueError, match="uint64"):
        encode_event(BlockRemoved((-1,)))
    with pytest.raises(ValueError, match="blocks x block_size"):
        encode_event(BlockStored((b"x" * 32,), None, (1, 2, 3), 4))
    with pytest.raises(TypeError, match="not a KV event"):
        encode_event("BlockStored")  # type: ignore[arg-type]


# -- real sockets -------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["bind_wildcard", "connect"])
def test_frames_seq_and_topic_over_real_sockets(ctx: zmq.Context, mode: str) -> None:
    sub = Subscriber(ctx, b"kv")
    if mode == "bind_wildcard":
        port = free_port()
        endpoint = f"tcp://*:{port}"
        sub.sock.connect(f"tcp://127.0.0.1:{port}")
    else:  # the publisher connects; the subscriber binds (as the vLLM recording)
        sub.sock.bind("tcp://127.0.0.1:*")
        endpoint = sub.sock.getsockopt_string(zmq.LAST_ENDPOINT)
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint, topic="kv")
    pub = ZmqEventPublisher(cfg)
    try:
        sub.wait_connected()
        assert pub.publish([]) is None and pub.next_seq == 0
        sent = [pub.publish([stored("tenant-a")]), pub.publish([stored(None), stored("b")])]
        sent.append(pub.publish([BlockRemoved((stored().block_hashes[0],), "GPU", 0)]))
        assert sent == [0, 1, 2]
        for want_seq, want_events in ((0, 1), (1, 2), (2, 1)):
            topic, seq, payload = sub.recv()
            assert topic == b"kv" and len(seq) == 8 and int.from_bytes(seq, "big") == want_seq
            ts, events, rank = msgpack.unpackb(payload, raw=False)
            assert isinstance(ts, float) and abs(ts - time.time()) < 60 and rank == 0
            assert len(events) == want_events and all("type" in e for e in events)
        pub.check_integrity()
    finally:
        pub.close()
        sub.close()


def test_late_dealer_replays_buffered_batches_then_end_marker(ctx: zmq.Context) -> None:
    cfg = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint="tcp://127.0.0.1:*",
        replay_endpoint="tcp://127.0.0.1:*",
        buffer_steps=4,
        topic="kv",
    )
    with ZmqEventPublisher(cfg) as pub:
        assert pub.replay_address is not None
        payloads = {}
        for i in range(6):
            seq = pub.publish([stored(f"t{i}")], ts=float(i))
            assert seq == i
        deadline = time.monotonic() + 5
        while pub.buffered_seqs() != [2, 3, 4, 5] and time.monotonic() < deadline:
            time.sleep(0.01)
        pub.check_integrity()
        replies = replay(ctx, pub.replay_address, 0)  # 0 and 1 left the buffer: oldest kept
        assert [r[0] for r in replies] == [b""] * 5
        vllm_replies = recorded(INT_RUN, "replay_reply_frames")
        assert replies[-1] == vllm_replies[-1] == [b"", b"", END_SEQ, b""]
        assert {len(r) for r in replies[:-1]} == {len(r) for r in vllm_replies[:-1]} == {4}
        for frames, want in zip(replies[:-1], [2, 3, 4, 5], strict=True):
            assert len(frames) == 4 and frames[1] == b"kv"
            assert int.from_bytes(frames[2], "big") == want
            payloads[want] = frames[3]
            batch = decode_replay_reply(frames)
            assert batch is not None and batch.seq == want and batch.ts == float(want)
        assert decode_replay_reply(replies[-1]) is None
        assert [int.from_bytes(r[2], "big") for r in replay(ctx, pub.replay_address, 4)[:-1]] == [
            4,
            5,
        ]
        assert replay(ctx, pub.replay_address, 99) == [[b"", b"", END_SEQ, b""]]


def test_a_replay_holds_every_batch_published_before_it(ctx: zmq.Context) -> None:
    """Batches still queued when a replay request arrives go out first, so the replay holds
    every seq handed out before it (the sender used to answer between two queued batches)."""
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*",
                         replay_endpoint="tcp://127.0.0.1:*", buffer_steps=1000, topic="kv")
    with ZmqEventPublisher(cfg) as pub:
        assert pub.replay_address is not None
        for burst in range(4):
            for i in range(200):
                pub.publish([stored(f"b{burst}-{i}")])
            frames = replay(ctx, pub.replay_address, 0)[:-1]
            assert [int.from_bytes(f[2], "big") for f in frames] == list(range(pub.next_seq))
        pub.check_integrity()


def test_invalid_replay_request_is_ignored_and_service_continues(ctx: zmq.Context) -> None:
    cfg = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint="tcp://127.0.0.1:*",
        replay_endpoint="tcp://127.0.0.1:*",
    )
    with ZmqEventPublisher(cfg) as pub:
        assert pub.replay_address is not None
        pub.publish([stored()])
        bad = ctx.socket(zmq.DEALER)
        bad.connect(pub.replay_address)
        bad.send_multipart([b"", b"\x00\x00", b"extra"])
        bad.send_multipart([b"", b"\x00" * 3])
        assert not bad.poll(300)
        bad.close(linger=0)
        assert len(replay(ctx, pub.replay_address, 0)) == 2


def test_publish_after_close_is_an_error_and_close_is_idempotent() -> None:
    pub = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint="inproc://x"))
    pub.close()
    pub.close()
    with pytest.raises(RuntimeError, match="closed"):
        pub.publish([stored()])


def test_bind_conflict_raises_at_construction() -> None:
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*")
    with ZmqEventPublisher(cfg) as first:
        taken = first.pub_address.replace("127.0.0.1", "*")
        with pytest.raises(PublisherSocketError, match=r"cannot bind .*: Address already in use"):
            ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=taken))


# -- block hashes -------------------------------------------------------------------------


def test_hash_chain_matches_recomputation_and_salts_separate() -> None:
    tokens = list(range(12))
    a = prompt_digests("tenant-a", tokens, 4)
    b = prompt_digests("tenant-b", tokens, 4)
    plain = prompt_digests(None, tokens, 4)
    assert len(a) == 3 and not set(a) & set(b) and not set(a) & set(plain)
    h0 = sha256_cbor((NONE_HASH, (0, 1, 2, 3), ("tenant-a",)))
    h1 = sha256_cbor((h0, (4, 5, 6, 7), None))
    assert a[:2] == [h0, h1] and a[2] == block_hash(h1, [8, 9, 10, 11], None)
    assert chain_digests(a[0], tokens[4:], 4, [None, None]) == a[1:]
    assert sha256_cbor("vllm-none-hash") == NONE_HASH and none_hash("0") != NONE_HASH
    assert prompt_digests("tenant-a", tokens, 4, root=none_hash("0")) != a
    assert prompt_digests(None, tokens[:7], 4) == plain[:1]
    with pytest.raises(ValueError, match="one entry per block"):
        chain_digests(None, tokens, 4, [None])
    with pytest.raises(ValueError, match="parent digest"):
        block_hash(b"short", [1], None)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.one_of(st.none(), st.binary(min_size=32, max_size=32)),
            st.lists(st.integers(0, 2**31), min_size=1, max_size=8).map(tuple),
            st.one_of(st.none(), st.tuples(st.text(max_size=6))),
        ),
        min_size=2,
        max_size=12,
        unique=True,
    )
)
def test_block_hash_is_deterministic_and_collision_free(
    inputs: list[tuple[bytes | None, list[int], tuple[str, ...] | None]],
) -> None:
    digests = [block_hash(p, t, k) for p, t, k in inputs]
    assert digests == [block_hash(p, list(t), k) for p, t, k in inputs]
    keys = {(NONE_HASH if p is None else p, tuple(t), k) for p, t, k in inputs}
    assert len(set(digests)) == len(keys)
    assert all(len(d) == 32 for d in digests)


# -- the radix cache listener -------------------------------------------------------------


class CollectingPublisher:
    """An in-process EventPublisher that keeps each batch (the ZMQ one is tested above)."""

    def __init__(self) -> None:
        self.batches: list[list[KVEvent]] = []

    def publish(self, events: Any, ts: float | None = None) -> int | None:
        self.batches.append(list(events))
        return len(self.batches) - 1

    def close(self) -> None:
        return None


def fill(cache: RadixCache, ns: str | None, tokens: list[int]) -> None:
    pool = cache.pool
    table = pool.allocate(pool.blocks_for(len(tokens)))
    cache.insert(ns, tokens, pool.slots(table, 0, len(tokens)))
    pool.decref(table)


def test_recorder_stores_chains_removes_and_clears() -> None:
    pub = CollectingPublisher()
    rec = KVEventRecorder(pub)
    cache = RadixCache(BlockPool(16, 4), rec)
    fill(cache, "tenant-a", list(range(10)))  # 2 full blocks + 2 tokens
    fill(cache, "tenant-a", list(range(14)))  # completes block 2
    fill(cache, "tenant-b", list(range(8)))
    assert rec.flush() == 0 and rec.flush() is None
    (s1, s2, s3) = pub.batches[0]
    assert isinstance(s1, BlockStored) and isinstance(s2, BlockStored)
    assert isinstance(s3, BlockStored)
    full_a = prompt_digests("tenant-a", list(range(14)), 4)
    assert list(s1.block_hashes) == full_a[:2] and s1.parent_block_hash is None
    assert s1.extra_keys == (("tenant-a",), None) and s1.token_ids == tuple(range(8))
    assert list(s2.block_hashes) == full_a[2:] and s2.parent_block_hash == full_a[1]
    assert s2.extra_keys == (None,) and s2.token_ids == (8, 9, 10, 11)
    assert list(s3.block_hashes) == prompt_digests("tenant-b", list(range(8)), 4)
    assert not set(s3.block_hashes) & set(full_a)
    assert (s1.medium, s1.group_idx, s1.kv_cache_spec_kind) == ("GPU", 0, "full_attention")
    assert rec.num_blocks == 5
    rec.check_integrity()

    assert cache.evict_span("tenant-a", list(range(14)), 4) > 0  # blocks 1 and 2 go
    rec.flush()
    removed = pub.batches[1]
    assert all(isinstance(e, BlockRemoved) and len(e.block_hashes) == 1 for e in removed)
    assert {e.block_hashes[0] for e in removed} == set(full_a[1:])  # type: ignore[union-attr]
    assert rec.num_blocks == 3

    assert cache.reset()
    fill(cache, None, list(range(4)))
    rec.flush()
    cleared, again = pub.batches[2]
    assert isinstance(cleared, AllBlocksCleared) and isinstance(again, BlockStored)
    assert again.extra_keys == (None,) and rec.num_blocks == 1
    rec.check_integrity()


def test_recorder_digests_always_match_the_tree() -> None:
    """After random inserts, evictions and span cuts, the recorder's blocks are exactly the
    full blocks on the tree's paths, recomputed from scratch."""
    import random

    rnd = random.Random(7)
    pub = CollectingPublisher()
    rec = KVEventRecorder(pub)
    cache = RadixCache(BlockPool(40, 4), rec)
    for _ in range(200):
        ns = rnd.choice([None, "a", "b"])
        tokens = [rnd.randrange(3) for _ in range(rnd.randrange(2, 20))]
        op = rnd.random()
        if op < 0.6:
            if cache.pool.num_free < cache.pool.blocks_for(len(tokens)):
                cache.evict(cache.pool.blocks_for(len(tokens)))
            if cache.pool.num_free >= cache.pool.blocks_for(len(tokens)):
                fill(cache, ns, tokens)
        elif op < 0.8:
            cache.evict(rnd.randrange(1, 4))
        elif op < 0.97:
            cache.evict_span(ns, tokens, rnd.randrange(len(tokens)))
        else:
            cache.reset()
        rec.flush()
        assert {*rec._digests.values()} == expected_digests(cache)
        rec.check_integrity()
    assert rec.unknown_parents == 0 and rec.unknown_removals == 0


def expected_digests(cache: RadixCache) -> set[bytes]:
    out: set[bytes] = set()
    for ns in cache.namespaces:
        for node in cache.nodes(ns):
            if node.children:
                continue
            path: list[int] = []
            n: Any = node
            while n.parent is not None:
                path[:0] = n.tokens
                n = n.parent
            out.update(prompt_digests(ns, path, cache.block_size))
    return out


def test_end_to_end_radix_cache_to_subscriber_decoder_and_shadow_index(
    ctx: zmq.Context,
) -> None:
    sub = Subscriber(ctx)
    sub.sock.bind("tcp://127.0.0.1:*")
    cfg = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=sub.sock.getsockopt_string(zmq.LAST_ENDPOINT),
        replay_endpoint="tcp://127.0.0.1:*",
        topic="kv@native@smollm2",
    )
    pub = ZmqEventPublisher(cfg)
    rec = KVEventRecorder(pub)
    cache = RadixCache(BlockPool(32, 4), rec)
    index = ShadowIndex()
    try:
        sub.wait_connected()
        fill(cache, "tenant-a", list(range(13)))
        fill(cache, None, list(range(9)))
        assert rec.flush() == 0
        fill(cache, "tenant-a", list(range(17)))
        cache.evict_span(None, list(range(9)), 0)
        assert rec.flush() == 1
        for want in (0, 1):
            batch = decode_message(sub.recv())
            assert batch.seq == want
            for event in batch.events:
                index.apply(event)
        folded = {fold_hash(d) for d in prompt_digests("tenant-a", list(range(17)), 4)}
        assert index.resident("tenant-a") == folded and index.resident(None) == frozenset()
        index.check_integrity()
        assert pub.replay_address is not None
        replayed = [decode_replay_reply(r) for r in replay(ctx, pub.replay_address, 0)]
        assert [b.seq for b in replayed if b is not None] == [0, 1] and replayed[-1] is None
    finally:
        pub.close()
        sub.close()


def test_bytes_and_legacy_modes_decode_with_the_adapter(ctx: zmq.Context) -> None:
    for legacy, int_mode in ((True, True), (False, False), (True, False)):
        cfg = KVEventsConfig(
            enable_kv_cache_events=True,
            endpoint="tcp://127.0.0.1:*",
            replay_endpoint="tcp://127.0.0.1:*",
            legacy_array_format=legacy,
            int_block_hashes=int_mode,
        )
        with ZmqEventPublisher(cfg) as pub:
            s = stored()
            pub.publish([s, BlockRemoved((s.block_hashes[1],), "GPU", 0), AllBlocksCleared()])
            assert pub.replay_address is not None
            frames = replay(ctx, pub.replay_address, 0)[0]
            raw = msgpack.unpackb(frames[3], raw=False)[1]
            assert isinstance(raw[0], list if legacy else dict)
            first = raw[0][1] if legacy else raw[0]["block_hashes"]
            assert isinstance(first[0], int if int_mode else bytes)
            batch = decode_replay_reply(frames)
            assert batch is not None
            got_stored, got_removed, got_cleared = batch.events
            assert isinstance(got_stored, BlockStored) and isinstance(got_removed, BlockRemoved)
            assert got_stored.block_hashes == tuple(fold_hash(h) for h in s.block_hashes)
            assert got_stored.extra_keys == (("tenant-a",), None)
            assert got_removed.block_hashes == (fold_hash(s.block_hashes[1]),)
            assert isinstance(got_cleared, AllBlocksCleared)


def test_engine_steps_publish_what_its_cache_does(ctx: zmq.Context) -> None:
    """A real LLMEngine (tiny random Llama) with the recorder as its cache listener, flushed
    once per step: a subscriber's shadow index ends up holding exactly the engine's blocks."""
    from native_engine.config import EngineConfig
    from native_engine.engine import LLMEngine
    from native_engine.request import SamplingParams
    from tests.native_engine.tiny_model import random_model

    cfg = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint="tcp://127.0.0.1:*",
        replay_endpoint="tcp://127.0.0.1:*",
    )
    engine_cfg = EngineConfig(
        block_size=4, num_blocks=64, max_num_batched_tokens=16, dtype="float32",
        attention_backend="torch",
    )  # fmt: skip
    with ZmqEventPublisher(cfg) as pub:
        rec = KVEventRecorder(pub)
        engine = LLMEngine.from_config(engine_cfg, listener=rec, loaded=random_model(seed=3))
        stem = list(range(3, 14))
        for salt, tail in (("tenant-a", [20, 21]), ("tenant-a", [22]), ("tenant-b", [20, 21])):
            params = SamplingParams(temperature=0, max_tokens=6, namespace=salt)
            engine.add_request(stem + tail, params)
            while engine.has_unfinished():
                engine.step()
                rec.flush()
        assert engine.cache is not None and pub.replay_address is not None
        index = index_from_replay(ctx, pub.replay_address, pub.next_seq)
        assert index.all_blocks() == {fold_hash(d) for d in expected_digests(engine.cache)}
        assert set(index.namespaces()) == {index.namespace_id(s) for s in ("tenant-a", "tenant-b")}
        assert engine.reset_prefix_cache()
        engine.add_request(stem, SamplingParams(temperature=0, max_tokens=2, namespace="c"))
        while engine.has_unfinished():
            engine.step()
            rec.flush()
        index = index_from_replay(ctx, pub.replay_address, pub.next_seq)
        assert index.all_blocks() == {fold_hash(d) for d in expected_digests(engine.cache)}
        assert set(index.namespaces()) == {index.namespace_id("c")}
        assert rec.unknown_parents == rec.unknown_removals == 0
        rec.check_integrity()
        pub.check_integrity()


def index_from_replay(ctx: zmq.Context, address: str, next_seq: int) -> ShadowIndex:
    """A fresh subscriber's view: replay everything from seq 0 into a shadow index."""
    index = ShadowIndex()
    batches = [decode_replay_reply(r) for r in replay(ctx, address, 0)]
    assert batches[-1] is None
    assert [b.seq for b in batches[:-1] if b is not None] == list(range(next_seq))
    for batch in batches[:-1]:
        assert batch is not None
        for event in batch.events:
            index.apply(event)
    index.check_integrity()
    return index
