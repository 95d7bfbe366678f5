"""Tiered KV residency on the real engine (tiny random Llama, fp32 torch path): a prefix served
from the device pool, the host tier or the disk tier gives token-identical greedy output, equal
to a cold run and to the dense reference; SEC-8 holds in every tier; corrupted, truncated or
swapped tier files are misses (deleted, metered) with the right output; the disk tier survives
a restart with the same model and is never read by another; quarantine clears every tier."""

from __future__ import annotations

import random
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from native_engine.engine import LLMEngine
from native_engine.model.loaded import LoadedModel
from native_engine.request import SamplingParams
from policies.eviction import RestoreRates
from tests.native_engine.reference import ReferenceModel
from tests.native_engine.tier_helpers import (
    block_bytes_of,
    build,
    evict_device,
    run,
    tier,
    tier_config,
)
from tests.native_engine.tiny_model import random_model

BS = 4
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PLACES = ("GPU", "CPU", "DISK")


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return random_model(seed=5)


@pytest.fixture(scope="module")
def reference(loaded: LoadedModel) -> ReferenceModel:
    return ReferenceModel(loaded.config, loaded.weights)


def prompt(seed: int, n: int = 23) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(3, 258) for _ in range(n)]


def engine_for(loaded: LoadedModel, place: str, tmp_path: Path, **kw: object) -> LLMEngine:
    """An engine whose evicted blocks land in `place` ("GPU": no tiers)."""
    bb = block_bytes_of(loaded, BS)
    host = 64 if place == "CPU" else 0
    disk = tmp_path / "kv" if place == "DISK" else None
    return build(loaded, **{**vars_of(tier_config(bb, host, disk, block_size=BS,
                                                  num_blocks=64)), **kw})


def vars_of(config: object) -> dict[str, object]:
    return {f: getattr(config, f) for f in config.__dataclass_fields__}  # type: ignore[attr-defined]


def with_params(namespace: str | None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, namespace=namespace)


@pytest.mark.parametrize("place", PLACES)
def test_round_trip_through_each_tier_is_token_identical(
        loaded: LoadedModel, reference: ReferenceModel, tmp_path: Path, place: str) -> None:
    p = prompt(1)
    cold = run(build(loaded, block_size=BS, num_blocks=64, dtype="float32",
                     attention_backend="torch", enable_prefix_caching=False), p, GREEDY)
    want = reference.greedy_generate(p, 8, ())
    assert list(cold.token_ids) == want
    engine = engine_for(loaded, place, tmp_path)
    first = run(engine, p, GREEDY)
    if place != "GPU":
        evict_device(engine)
        assert tier(engine, place).resident_blocks == (len(p) + 8 - 1) // BS
    second = run(engine, p, GREEDY)
    assert list(first.token_ids) == list(second.token_ids) == want
    assert second.cached_tokens == (len(p) - 1) // BS * BS if place != "GPU" \
        else second.cached_tokens == len(p) - 1
    if place != "GPU":
        stats = tier(engine, place)
        assert stats.promotions == stats.hits == (len(p) - 1) // BS
        assert stats.restore_failures == 0


@pytest.mark.parametrize("place", PLACES)
def test_sec8_each_tier_serves_only_its_namespace(
        loaded: LoadedModel, tmp_path: Path, place: str) -> None:
    p = prompt(2)
    engine = engine_for(loaded, place, tmp_path)
    own = run(engine, p, with_params("salt-a"))
    if place != "GPU":
        evict_device(engine)
    intruder = run(engine, p, with_params("salt-b"))
    unsalted = run(engine, p, with_params(None))
    assert intruder.cached_tokens == 0 and unsalted.cached_tokens == 0
    if place != "GPU":  # the intruders' own copies must not push the tenant's out
        evict_device(engine)
    again = run(engine, p, with_params("salt-a"))  # positive control
    assert again.cached_tokens >= (len(p) - 1) // BS * BS
    assert own.token_ids == intruder.token_ids == again.token_ids


def disk_files(engine: LLMEngine) -> list[Path]:
    assert engine.tiers is not None and engine.tiers.disk is not None
    return sorted(engine.tiers.disk.directory.glob("*.kv"))


def file_of_block(engine: LLMEngine, p: list[int], k: int, namespace: str | None = None) -> Path:
    assert engine.tiers is not None and engine.tiers.disk is not None
    digests = engine.tiers.chain(namespace, p, k + 1)
    return engine.tiers.disk.path_of(digests[k])


def corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40  # a payload byte
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-17])


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "swap", "garbage"])
def test_damaged_disk_file_is_a_miss_with_the_right_output(
        loaded: LoadedModel, reference: ReferenceModel, tmp_path: Path, damage: str) -> None:
    p = prompt(3)
    engine = engine_for(loaded, "DISK", tmp_path)
    run(engine, p, GREEDY)
    evict_device(engine)
    target, other = file_of_block(engine, p, 1), file_of_block(engine, p, 2)
    assert target.exists() and other.exists()
    if damage == "corrupt":
        corrupt(target)
    elif damage == "truncate":
        truncate(target)
    elif damage == "swap":  # two valid files under each other's names
        a, b = target.read_bytes(), other.read_bytes()
        target.write_bytes(b)
        other.write_bytes(a)
    else:
        target.write_bytes(b"not a safetensors file")
    out = run(engine, p, GREEDY)
    assert list(out.token_ids) == reference.greedy_generate(p, 8, ())
    assert out.cached_tokens == BS  # block 0 restored, block 1 rejected: recomputed from there
    assert not target.exists() or target.read_bytes() != b"not a safetensors file"
    stats = tier(engine, "DISK")
    assert stats.restore_failures == 1 and stats.promotions == 1


def test_restart_hits_from_disk_and_another_model_never_does(
        loaded: LoadedModel, tmp_path: Path) -> None:
    p = prompt(4)
    first = engine_for(loaded, "DISK", tmp_path)
    want = run(first, p, GREEDY)
    evict_device(first)
    files = disk_files(first)
    assert len(files) == (len(p) + 8 - 1) // BS
    del first
    again = engine_for(loaded, "DISK", tmp_path)  # a restart: a fresh engine, the same files
    assert again.tiers is not None and again.tiers.disk is not None
    assert len(again.tiers.disk) == len(files)
    out = run(again, p, GREEDY)
    assert out.cached_tokens == (len(p) - 1) // BS * BS and out.token_ids == want.token_ids
    other = engine_for(random_model(seed=6), "DISK", tmp_path)
    assert other.tiers is not None and other.tiers.disk is not None
    assert len(other.tiers.disk) == 0
    assert other.tiers.disk.directory != again.tiers.disk.directory
    assert run(other, p, GREEDY).cached_tokens == 0
    assert disk_files(again) == files  # the other model's engine left them alone


def test_quarantine_clears_a_span_resident_in_all_three_tiers(
        loaded: LoadedModel, tmp_path: Path) -> None:
    bb = block_bytes_of(loaded, BS)
    config = tier_config(bb, host_blocks=9, disk_dir=tmp_path / "kv", block_size=BS,
                         num_blocks=64)
    engine = build(loaded, **vars_of(config))
    p = prompt(5, 27)
    run(engine, p, with_params("victim"))
    run(engine, p, with_params("bystander"))
    evict_device(engine)  # the victim keeps block 0 in host RAM, the rest moved on to disk
    run(engine, p[:BS + 2], with_params("victim"))  # block 0 back in the pool too
    assert engine.tiers is not None
    before = engine.tiers.resident()
    mine = set(engine.tiers.chain("victim", p, len(p) // BS))
    theirs = set(engine.tiers.chain("bystander", p, len(p) // BS))
    assert mine & before["CPU"] and mine & before["DISK"] and engine.cache is not None
    assert engine.cache.match("victim", p).length >= BS  # and the device pool
    removal = engine.remove_span("victim", p, 0)
    assert removal.device_tokens > 0 and removal.ok
    after = engine.tiers.resident()
    for medium in ("CPU", "DISK"):
        assert not mine & after[medium]
        assert before[medium] - after[medium] == next(
            r.removed for r in removal.tiers if r.medium == medium)
        assert theirs & before[medium] == theirs & after[medium]
    assert not [d for d in mine if engine.tiers.disk.path_of(d).exists()]  # type: ignore[union-attr]
    assert engine.cache.match("victim", p).length == 0
    assert run(engine, p, with_params("victim")).cached_tokens == 0
    engine.check_integrity()


def test_a_tier_slower_than_recompute_is_never_used(loaded: LoadedModel, tmp_path: Path,
                                                     reference: ReferenceModel) -> None:
    """The cost model: with measured rates under which restoring loses, blocks are dropped
    and recomputed (no demotion, no restore), and the output is unchanged."""
    bb = block_bytes_of(loaded, BS)
    slow = RestoreRates(1e9, {"CPU": 1e3, "DISK": 1e3})  # restores far slower than prefill
    engine = build(loaded, **vars_of(tier_config(bb, host_blocks=8, disk_dir=tmp_path / "kv",
                                                 block_size=BS, num_blocks=64,
                                                 kv_restore_rates=slow)))
    p = prompt(9)
    run(engine, p, GREEDY)
    evict_device(engine)
    out = run(engine, p, GREEDY)
    assert out.cached_tokens == 0 and list(out.token_ids) == reference.greedy_generate(p, 8, ())
    for medium in ("CPU", "DISK"):
        stats = tier(engine, medium)
        assert not stats.restore_pays and stats.demotions == stats.resident_blocks == 0


def test_host_victims_move_to_disk_only_when_disk_pays(loaded: LoadedModel,
                                                       tmp_path: Path) -> None:
    bb = block_bytes_of(loaded, BS)
    rates = RestoreRates(1.0, {"CPU": 1e15, "DISK": 1e-3})
    engine = build(loaded, **vars_of(tier_config(bb, host_blocks=3, disk_dir=tmp_path / "kv",
                                                 block_size=BS, num_blocks=64,
                                                 kv_restore_rates=rates)))
    run(engine, prompt(10), GREEDY)
    evict_device(engine)
    assert tier(engine, "CPU").resident_blocks == 3
    assert tier(engine, "DISK").resident_blocks == 0


def test_flush_empties_every_tier_and_deletes_the_files(loaded: LoadedModel,
                                                        tmp_path: Path) -> None:
    bb = block_bytes_of(loaded, BS)
    engine = build(loaded, **vars_of(tier_config(bb, host_blocks=3, disk_dir=tmp_path / "kv",
                                                 block_size=BS, num_blocks=64)))
    p = prompt(11)
    run(engine, p, with_params("t"))
    evict_device(engine)
    assert disk_files(engine) and tier(engine, "CPU").resident_blocks == 3
    report = engine.flush_prefix_cache()
    assert report is not None and all(r.ok for r in report)
    assert {r.medium for r in report} == {"CPU", "DISK"}
    assert not disk_files(engine) and tier(engine, "CPU").resident_blocks == 0
    assert run(engine, p, with_params("t")).cached_tokens == 0


PROMPTS = [prompt(20, 14), prompt(20, 14)[:9] + prompt(21, 10), prompt(22, 17),
           prompt(20, 14) + prompt(23, 6)]


@pytest.fixture(scope="module")
def wanted(reference: ReferenceModel) -> list[list[int]]:
    return [reference.greedy_generate(p, 6, ()) for p in PROMPTS]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.sampled_from(["run", "run", "evict", "remove", "flush"]),
                              st.integers(0, len(PROMPTS) - 1), st.sampled_from("abc"),
                              st.integers(0, 13)), min_size=1, max_size=14))
def test_random_traffic_keeps_invariants_and_outputs(
        loaded: LoadedModel, wanted: list[list[int]], ops: list[tuple[str, int, str, int]]
) -> None:
    """Any mix of requests (3 namespaces, shared stems), evictions, span removals and flushes
    over a small pool with tiny tiers: integrity holds, outputs equal the reference, and a
    removed span is in no tier afterwards."""
    bb = block_bytes_of(loaded, BS)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        engine = build(loaded, **vars_of(tier_config(
            bb, host_blocks=4, disk_dir=Path(tmp), disk_blocks=12, block_size=BS,
            num_blocks=16, max_num_batched_tokens=16)))
        tiers = engine.tiers
        assert tiers is not None
        for op, i, ns, start in ops:
            p = PROMPTS[i]
            if op == "run":
                out = run(engine, p, replace(params, namespace=ns))
                assert list(out.token_ids) == wanted[i]
            elif op == "evict":
                evict_device(engine)
            elif op == "remove":
                removal = engine.remove_span(ns, p, min(start, len(p) - 1))
                assert removal.ok
                k = min(start, len(p) - 1) // BS
                doomed = set(tiers.chain(ns, p, len(p) // BS)[k:])
                assert not doomed & set().union(*tiers.resident().values())
            else:
                assert engine.flush_prefix_cache() is not None
            engine.check_integrity()
        tiers.close()


@pytest.mark.parametrize(("kw", "needle"), [
    ({"kv_offloading_size": 0}, "kv_offloading_size"),
    ({"kv_offloading_size": float("nan")}, "kv_offloading_size"),
    ({"kv_disk_dir": "/tmp/kv"}, "go together"),
    ({"kv_disk_size": 1.0}, "go together"),
    ({"kv_disk_dir": "", "kv_disk_size": 1.0}, "non-empty"),
    ({"kv_offloading_size": 1.0, "enable_prefix_caching": False}, "prefix caching"),
    ({"kv_offloading_size": 1.0, "kv_restore_rates": {"CPU": 1}}, "RestoreRates"),
])
def test_tier_settings_are_validated_once(kw: dict, needle: str) -> None:
    from native_engine.config import EngineConfig

    with pytest.raises(ValueError, match=needle):
        EngineConfig(**kw)


def test_disk_index_is_rebuilt_from_valid_files_only(loaded: LoadedModel, tmp_path: Path) -> None:
    engine = engine_for(loaded, "DISK", tmp_path)
    p = prompt(12)
    run(engine, p, GREEDY)
    evict_device(engine)
    assert engine.tiers is not None and engine.tiers.disk is not None
    directory = engine.tiers.disk.directory
    good = disk_files(engine)
    (directory / ".tmp-crashed").write_bytes(b"half a file")
    (directory / ("ab" * 32 + ".kv")).write_bytes(good[0].read_bytes())  # a name it isn't
    (directory / ("cd" * 32 + ".kv")).write_bytes(b"garbage")
    again = engine_for(loaded, "DISK", tmp_path)
    assert again.tiers is not None and again.tiers.disk is not None
    assert sorted(directory.iterdir()) == good
    assert len(again.tiers.disk) == len(good) and again.tiers.disk.rejected == 2
    assert run(again, p, GREEDY).cached_tokens == (len(p) - 1) // BS * BS


def test_a_write_cancelled_before_the_writer_sees_it_does_not_stall_drain(
        tmp_path: Path) -> None:
    """A block removed while still queued: the writer skips it, and a drain() already
    waiting for it returns. Repeated, since which thread runs first is up to the OS."""
    import threading

    import torch

    from native_engine.kvcache.disk_tier import DiskTier, KVLayout
    from native_engine.kvcache.tier_entry import TierEntry

    layout = KVLayout("test-model", "float32", BS, 2, 2, 16)
    disk = DiskTier(tmp_path, layout, 64 * layout.block_bytes)
    kv = torch.zeros(layout.block_shape)
    for i in range(200):
        entry = TierEntry(i.to_bytes(32, "big"), None, tuple(range(BS)), "t", True,
                          layout.block_bytes)
        with disk._lock:  # the writer thread cannot take anything from the queue meanwhile
            assert disk.write(entry, kv)
            assert disk.remove(entry.digest) is None
            waiter = threading.Thread(target=disk.drain, daemon=True)
            waiter.start()
        waiter.join(5)
        assert not waiter.is_alive(), f"drain() stalled on a cancelled write (round {i})"
    assert not list(disk.directory.iterdir()) and len(disk) == 0
    disk.close()
    disk.check_integrity()
