"""SEC-17, KV-event surfaces: sockets stay on loopback unless allowed (checked on the real
listening sockets), the native publisher listens on loopback by default, the shadow index is
bounded by the engine's block count (a real BlockStored flood), only configured ranks exist,
and namespaces are kept as keyed digests, never as salts."""

from __future__ import annotations

import asyncio
import ipaddress
import tracemalloc
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from adapters.vllm.kv_endpoints import KVEndpointError
from adapters.vllm.kv_subscriber import KVEventSubscriber, KVSubscriberConfig, SyncState
from adapters.vllm.shadow_index import ShadowIndex
from governor.cli import main
from governor.config import ConfigError, parse_config
from governor.serve import build_vllm_driver
from native_engine.serve.kv_config import KVEventsConfig
from native_engine.serve.kv_publisher import ZmqEventPublisher
from policies.kv_sockets import loopback_form, remote_refusal
from policies.salts import SaltKey, kv_namespace_key, namespace_digest
from schemas.kv_events import BlockStored
from tests.adapters.test_vllm_kv_subscriber import FakeVLLMSockets, batch_frames, free_port, store
from tests.adapters.vllm_imitation import Imitation, start_imitation


def listening_hosts(port: int) -> set[str]:
    """Local addresses of the sockets listening on `port`, read from the kernel."""
    hosts = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, state = fields[1], fields[3]
            host_hex, port_hex = address.split(":")
            if state != "0A" or int(port_hex, 16) != port:
                continue
            raw = bytes.fromhex(host_hex)
            # /proc prints the address as native-endian 32-bit words
            words = [raw[i:i + 4][::-1] for i in range(0, len(raw), 4)]
            hosts.add(str(ipaddress.ip_address(b"".join(words))))
    return hosts


# --- loopback unless allowed -----------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["tcp://*:5557", "tcp://0.0.0.0:5557", "tcp://[::]:5557",
                                      "tcp://10.1.2.3:5557", "tcp://eth0:5557",
                                      "tcp://kv.example.com:5557"])
def test_off_loopback_addresses_refused_unless_allowed(endpoint: str) -> None:
    assert "allow_remote_kv" in (remote_refusal(endpoint, "subscriber bind", False) or "")
    assert remote_refusal(endpoint, "subscriber bind", True) is None


def test_loopback_and_local_transports_allowed() -> None:
    for endpoint in ("tcp://127.0.0.1:5557", "tcp://127.3.4.5:1", "tcp://[::1]:5557",
                     "tcp://localhost:5557", "ipc:///tmp/kv", "inproc://kv"):
        assert remote_refusal(endpoint, "subscriber bind", False) is None, endpoint
    assert loopback_form("tcp://*:5557") == "tcp://127.0.0.1:5557"
    assert loopback_form("tcp://[::]:5557") == "tcp://[::1]:5557"
    assert loopback_form("tcp://127.0.0.1:5557") == "tcp://127.0.0.1:5557"


@pytest.mark.parametrize(("endpoint", "mode"), [("tcp://0.0.0.0:5557", "auto"),
                                                ("tcp://*:5557", "bind"),
                                                ("tcp://10.1.2.3:5557", "connect"),
                                                ("tcp://192.168.1.9:5557", "auto")])
def test_subscriber_refuses_to_leave_loopback(endpoint: str, mode: str) -> None:
    with pytest.raises(KVEndpointError, match="allow_remote_kv"):
        KVSubscriberConfig(endpoint=endpoint, mode=mode)  # type: ignore[arg-type]
    KVSubscriberConfig(endpoint=endpoint, mode=mode, allow_remote=True)  # type: ignore[arg-type]
    with pytest.raises(KVEndpointError, match="replay dial"):
        KVSubscriberConfig(endpoint="tcp://127.0.0.1:5557", replay_endpoint="tcp://10.0.0.1:5558")


async def test_subscriber_binds_loopback_only() -> None:
    port = free_port()
    kv = KVEventSubscriber(KVSubscriberConfig(endpoint=f"tcp://127.0.0.1:{port}"))
    await kv.start()
    try:
        assert listening_hosts(port) == {"127.0.0.1"}
    finally:
        await kv.close()


def test_governor_config_refuses_a_wildcard_kv_bind_unless_allowed() -> None:
    raw = {"engine": {"kind": "vllm", "base_url": "http://127.0.0.1:8000",
                      "kv_events": "tcp://0.0.0.0:5557"}}
    with pytest.raises(ConfigError, match="allow_remote_kv"):
        build_vllm_driver(parse_config(raw).engine)
    raw["engine"]["allow_remote_kv"] = True
    driver = build_vllm_driver(parse_config(raw).engine)
    assert driver.kv is not None and driver.kv.config.allow_remote  # type: ignore[attr-defined]


def test_native_publisher_defaults_to_loopback() -> None:
    port = free_port()
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}",
                            replay_endpoint=f"tcp://*:{free_port()}")
    with ZmqEventPublisher(config) as pub:
        assert pub.pub_address == f"tcp://127.0.0.1:{port}"
        assert listening_hosts(port) == {"127.0.0.1"}
        assert pub.replay_address is not None and "127.0.0.1" in pub.replay_address
    allowed = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}",
                             allow_remote_kv=True)
    with ZmqEventPublisher(allowed):
        assert listening_hosts(port) == {"0.0.0.0"}
    for endpoint in ("tcp://0.0.0.0:5557", "tcp://10.1.2.3:5557"):
        with pytest.raises(ValueError, match="allow_remote_kv"):
            KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint)


def test_fak_engine_serve_refuses_a_remote_kv_endpoint_in_one_line(capsys) -> None:
    config = '{"enable_kv_cache_events": true, "endpoint": "tcp://10.1.2.3:5557"}'
    assert main(["engine", "serve", "--kv-events-config", config]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "allow_remote_kv" in lines[0], lines


# --- bounded index, configured ranks, digested namespaces ---------------------------------


@pytest.fixture
async def ctx():
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


async def follow(ctx, data_parallel_size: int = 1, **kw) -> tuple[FakeVLLMSockets,
                                                                  KVEventSubscriber]:
    port = free_port()
    engine = FakeVLLMSockets(ctx, port)
    subscriber = KVEventSubscriber(KVSubscriberConfig(
        endpoint=f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://*:{engine.replay_port}",
        topic="kv", data_parallel_size=data_parallel_size, **kw))
    await subscriber.start()
    assert await subscriber.wait_connected(5.0)
    await asyncio.sleep(0.3)
    return engine, subscriber


def flood_batch(seq: int, first: int, count: int) -> list[bytes]:
    """One batch storing `count` fresh root blocks, each with a salt and 32 token ids."""
    return batch_frames(seq, [store(first + i, salt=f"flood-{seq}") for i in range(count)])


@pytest.mark.slow
async def test_block_stored_flood_keeps_the_index_bounded(ctx) -> None:
    engine, subscriber = await follow(ctx, history_max_events=2000)
    subscriber.set_block_capacity(500)  # what the engine's cache_config_info says
    try:
        await engine.publish(batch_frames(0, [store(1)]))
        assert await subscriber.wait_for_seq(0)
        tracemalloc.start()
        before, _ = tracemalloc.get_traced_memory()
        for seq in range(1, 25):  # 24 batches x 1,000 blocks: 48x the engine's pool
            await engine.publish(flood_batch(seq, seq * 10_000, 1000), buffer=False)
        assert await subscriber.wait_for_seq(24, timeout_s=60.0)
        grown = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        index = subscriber.index()
        index.check_integrity()
        assert len(index) == 500 and index.overflow_drops == 24_000 - 499
        assert subscriber.state() is SyncState.UNCERTAIN
        print(f"flood: memory grew {grown / 2**20:.2f} MiB")
        assert grown < 4 << 20, f"the flood grew memory by {grown / 2**20:.1f} MiB"
        # An AllBlocksCleared (a reset) makes the index whole again.
        await engine.publish(batch_frames(25, [{"type": "AllBlocksCleared"}, store(7)]))
        assert await subscriber.wait_for_seq(25)
        assert subscriber.state() is SyncState.SYNCED and subscriber.index().all_blocks() == {7}
    finally:
        await subscriber.close()
        await engine.close()


def test_index_capacity_drops_stores_and_counts_them() -> None:
    index = ShadowIndex(capacity=3)
    index.apply(BlockStored((1, 2, 3, 4, 5), None, (), 32, extra_keys=(("s",), None, None,
                                                                       None, None)))
    index.check_integrity()
    assert index.all_blocks() == {1, 2, 3} and index.overflow_drops == 2
    index.clear()
    assert index.overflow_drops == 0 and len(index) == 0


async def test_capacity_is_learnt_from_the_engines_cache_config() -> None:
    """The driver bounds each rank's index by `num_gpu_blocks` of vllm:cache_config_info."""
    runner, base_url = await start_imitation(Imitation())
    port = free_port()
    pub_ctx = zmq.asyncio.Context()
    pub = pub_ctx.socket(zmq.PUB)
    pub.connect(f"tcp://127.0.0.1:{port}")
    try:
        raw = {"engine": {"kind": "vllm", "base_url": base_url,
                          "kv_events": f"tcp://127.0.0.1:{port}"}}
        driver = build_vllm_driver(parse_config(raw).engine)
        await driver.start()
        try:
            assert driver.capabilities.num_blocks == 24  # the recorded server's pool
            assert driver.kv.index().capacity == 24  # type: ignore[attr-defined]
        finally:
            await driver.close()
    finally:
        pub.close(linger=0)
        pub_ctx.destroy(linger=0)
        await runner.cleanup()


@pytest.mark.slow
async def test_only_configured_ranks_are_accepted(ctx) -> None:
    engine, subscriber = await follow(ctx)
    try:
        await engine.publish(batch_frames(0, [store(1)], rank=0))
        await engine.publish(batch_frames(0, [store(2)], rank=5))
        await engine.publish(batch_frames(0, [store(3)], rank=255))
        await engine.publish(batch_frames(1, [store(4)], rank=0))
        assert await subscriber.wait_for_seq(1)
        assert subscriber.ranks() == (0,) and subscriber.foreign_rank_batches == 2
        assert subscriber.index().all_blocks() == {1, 4}
        with pytest.raises(KeyError):
            subscriber.index(5)
    finally:
        await subscriber.close()
        await engine.close()


@pytest.mark.slow
async def test_namespaces_are_keyed_digests_never_salts(ctx) -> None:
    salt_key = SaltKey(b"k" * 32)
    key = kv_namespace_key(salt_key)
    port = free_port()
    engine = FakeVLLMSockets(ctx, port)
    subscriber = KVEventSubscriber(KVSubscriberConfig(
        endpoint=f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://*:{engine.replay_port}",
        topic="kv"), namespace_key=key)
    await subscriber.start()
    secret = "fak1-tenant-secret-salt"
    try:
        assert await subscriber.wait_connected(5.0)
        await asyncio.sleep(0.3)
        await engine.publish(batch_frames(0, [store(1, salt=secret), store(2, parent=1)]))
        assert await subscriber.wait_for_seq(0)
        index = subscriber.index()
        digest = namespace_digest(key, secret)
        assert index.namespaces() == {digest: 2} and index.resident(secret) == {1, 2}
        assert index.get(1).namespace == digest and secret not in repr(vars(index))
        kept = subscriber.evidence_since(subscriber.watermark()).batches
        history = repr(subscriber._ranks[0].history)  # what stays in memory
        assert secret not in history and "extra_keys=None" in history and not kept
        assert digest != secret and secret not in digest
        assert namespace_digest(kv_namespace_key(SaltKey(b"j" * 32)), secret) != digest
    finally:
        await subscriber.close()
        await engine.close()


def test_governor_gives_the_index_a_key_derived_from_its_salt_key() -> None:
    raw = {"engine": {"kind": "vllm", "base_url": "http://127.0.0.1:8000",
                      "kv_events": "tcp://127.0.0.1:5557"}}
    key = kv_namespace_key(SaltKey(b"z" * 32))
    driver = build_vllm_driver(parse_config(raw).engine, key)
    index = driver.kv.index()  # type: ignore[attr-defined]
    assert index.namespace_id("s") == namespace_digest(key, "s")
