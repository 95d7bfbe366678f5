"""The KV tiers on the KV-event surface and /metrics (tiny random Llama, real ZeroMQ sockets):
a subscriber's shadow index holds exactly what each medium holds ("GPU", "CPU", "DISK"), with
namespaces certain; span removal, a flush and a restart are reflected; the metrics export per
tier counters that match the engine's."""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq

from adapters.vllm.kv_decode import fold_hash
from adapters.vllm.shadow_index import ShadowIndex
from native_engine.engine import LLMEngine
from native_engine.kvcache.events import KVEventRecorder
from native_engine.request import SamplingParams
from native_engine.serve.kv_config import KVEventsConfig
from native_engine.serve.kv_publisher import ZmqEventPublisher
from native_engine.serve.metrics import CacheInfo, ServerMetrics
from tests.native_engine.test_kv_publisher import expected_digests, index_from_replay
from tests.native_engine.tier_helpers import block_bytes_of, tier_config
from tests.native_engine.tiny_model import random_model

BS = 4


@pytest.fixture
def ctx() -> zmq.Context:
    context = zmq.Context()
    yield context
    context.term()


def by_medium(index: ShadowIndex) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for h in index.all_blocks():
        info = index.get(h)
        assert info is not None
        for medium in info.media:
            out.setdefault(medium, set()).add(h)
    return out


def engine_view(engine: LLMEngine) -> dict[str, set[int]]:
    assert engine.cache is not None and engine.tiers is not None
    view = {m: {fold_hash(d) for d in ds} for m, ds in engine.tiers.resident().items()}
    view["GPU"] = {fold_hash(d) for d in expected_digests(engine.cache)}
    return {m: hs for m, hs in view.items() if hs}


def run(engine: LLMEngine, rec: KVEventRecorder, prompt: list[int], salt: str) -> None:
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=5, namespace=salt))
    while engine.has_unfinished():
        engine.step()
    rec.flush()


def test_every_medium_is_published_and_rebuilt(ctx: zmq.Context, tmp_path: Path) -> None:
    loaded = random_model(seed=7)
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*",
                         replay_endpoint="tcp://127.0.0.1:*")
    config = tier_config(block_bytes_of(loaded, BS), host_blocks=5, disk_dir=tmp_path / "kv",
                         block_size=BS, num_blocks=10, max_num_batched_tokens=16)
    with ZmqEventPublisher(cfg) as pub:
        rec = KVEventRecorder(pub)
        engine = LLMEngine.from_config(config, listener=rec, loaded=loaded)
        assert engine.tiers is not None and engine.cache is not None
        prompts = {salt: [(7 * i + k) % 250 + 3 for i in range(18)]
                   for k, salt in enumerate(("tenant-a", "tenant-b", "tenant-c", "tenant-d"))}
        for salt, prompt in prompts.items():  # 10 pool blocks: later ones push earlier down
            run(engine, rec, prompt, salt)
        run(engine, rec, prompts["tenant-a"], "tenant-a")  # promoted back up
        engine.tiers.drain()
        assert pub.replay_address is not None
        index = index_from_replay(ctx, pub.replay_address, pub.next_seq)
        want = engine_view(engine)
        assert {"GPU", "CPU", "DISK"} <= want.keys()
        assert by_medium(index) == want
        assert not index.uncertain() and set(index.namespaces()) == {
            index.namespace_id(salt) for salt in prompts}
        stats = {s.medium: s for s in engine.stats().tiers}
        assert stats["CPU"].promotions + stats["DISK"].promotions > 0

        removal = engine.remove_span("tenant-a", prompts["tenant-a"], 0)
        rec.flush()
        assert removal.ok
        index = index_from_replay(ctx, pub.replay_address, pub.next_seq)
        assert by_medium(index) == engine_view(engine)
        assert index.namespace_id("tenant-a") not in index.namespaces()

        metrics = ServerMetrics("tiny", CacheInfo(BS, 10, True))
        metrics.update(engine.stats())
        metrics.check_integrity(engine.stats())
        text = metrics.render().decode()
        for medium in ("CPU", "DISK"):
            s = next(t for t in engine.stats().tiers if t.medium == medium)
            assert (f'fak_kv_tier_resident_blocks{{engine="0",medium="{medium}",'
                    f'model_name="tiny"}} {float(s.resident_blocks)}') in text
            assert (f'fak_kv_tier_promotions_total{{engine="0",medium="{medium}",'
                    f'model_name="tiny"}} {float(s.promotions)}') in text
        assert 'fak_kv_tier_restore_pays{engine="0",medium="DISK",model_name="tiny"} 1.0' in text

        on_disk = {fold_hash(d) for d in engine.tiers.resident()["DISK"]}
        assert engine.reset_prefix_cache()
        rec.flush()
        assert not list(engine.tiers.disk.directory.iterdir())  # type: ignore[union-attr]
        index = index_from_replay(ctx, pub.replay_address, pub.next_seq)
        assert len(index) == 0
        rec.check_integrity()
        assert rec.unknown_parents == rec.unknown_removals == 0
    assert on_disk


def test_a_restart_announces_the_disk_tier_without_salts(ctx: zmq.Context,
                                                         tmp_path: Path) -> None:
    loaded = random_model(seed=8)
    config = tier_config(block_bytes_of(loaded, BS), disk_dir=tmp_path / "kv", block_size=BS,
                         num_blocks=32)
    first = LLMEngine.from_config(config, loaded=loaded)
    first.generate([list(range(3, 30))], SamplingParams(temperature=0, max_tokens=3,
                                                        namespace="tenant-a"))
    assert first.cache is not None and first.tiers is not None
    first.cache.evict(first.pool.num_blocks)
    first.tiers.close()
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.1:*",
                         replay_endpoint="tcp://127.0.0.1:*")
    with ZmqEventPublisher(cfg) as pub:
        rec = KVEventRecorder(pub)
        again = LLMEngine.from_config(config, listener=rec, loaded=loaded)
        rec.flush()
        assert again.tiers is not None and pub.replay_address is not None
        index = index_from_replay(ctx, pub.replay_address, pub.next_seq)
        assert by_medium(index) == {"DISK": {fold_hash(d) for d in
                                             again.tiers.resident()["DISK"]}}
        assert index.uncertain() == index.all_blocks()  # no salt is ever written to disk
        rec.check_integrity()
