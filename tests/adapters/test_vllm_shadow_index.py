"""ShadowIndex: oracle cases 2, 4, 8, 9 of docs/reference/vllm-surfaces.md §2.9, namespaces,
recorded runs."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from adapters.vllm.kv_decode import decode_message, decode_payload
from adapters.vllm.shadow_index import (
    ShadowIndex,
    chain_key,
    namespace_root,
    prompt_chain,
    salt_from_root_keys,
)
from schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from tests.adapters.vllm_vectors import RUNS, fold, kv_recording, plain_decode


def stored(hashes, parent=None, keys=None, medium="GPU", lora=None) -> BlockStored:
    return BlockStored(
        tuple(hashes), parent, (), 32, medium=medium, extra_keys=keys, lora_name=lora
    )


def test_salt_from_block0_inherited_down_the_chain() -> None:
    index = ShadowIndex()
    index.apply(stored([1, 2, 3], keys=(("tenant-a",), None, None)))
    index.apply(stored([4], parent=3, keys=(None,)))  # decode-time block, null keys
    index.apply(stored([9], keys=(None,)))  # no salt
    index.check_integrity()
    assert index.resident("tenant-a") == {1, 2, 3, 4}
    assert index.resident(None) == {9}
    assert index.get(4).parent == 3 and index.get(1).parent is None
    assert not any(f.name == "token_ids" for f in dataclasses.fields(index.get(1)))


def test_oracle2_all_blocks_cleared_clears_every_tier() -> None:
    index = ShadowIndex()
    index.apply(stored([1, 2], keys=(("s",), None)))
    index.apply(stored([1, 2], keys=(("s",), None), medium="CPU"))
    batch = decode_payload(msgpack.packb([0.0, [["AllBlocksCleared"]], 0]), 0)
    for event in batch.events:
        index.apply(event)
    index.check_integrity()
    assert len(index) == 0


def test_media_are_tracked_separately() -> None:
    index = ShadowIndex()
    index.apply(stored([1], keys=(("s",),)))
    index.apply(stored([1], keys=(("s",),), medium="CPU"))
    index.apply(BlockRemoved((1,), "GPU"))
    assert index.get(1).media == {"CPU"}
    index.apply(AllBlocksCleared(medium="CPU"))
    index.check_integrity()
    assert len(index) == 0


def test_oracle4_unknown_parent_is_kept_uncertain() -> None:
    index = ShadowIndex()
    index.apply(stored([5, 6], parent=404, keys=(None, None)))
    index.apply(stored([7], parent=6))
    index.check_integrity()
    assert index.uncertain() == {5, 6, 7}
    assert index.namespaces() == {}


def test_oracle8_repeated_hash_in_one_store_is_a_noop() -> None:
    index = ShadowIndex()
    index.apply(stored([1, 2, 1], keys=(("s",), None, None)))
    assert len(index) == 0 and index.anomalies == 1
    index.check_integrity()


def test_oracle9_removing_an_unseen_hash_is_a_noop() -> None:
    index = ShadowIndex()
    index.apply(stored([1], keys=(("s",),)))
    index.apply(BlockRemoved((999,), "GPU"))
    index.check_integrity()
    assert index.resident("s") == {1}


def test_repeated_store_is_idempotent() -> None:
    index = ShadowIndex()
    for _ in range(3):
        index.apply(stored([1, 2], keys=(("s",), None)))
    index.check_integrity()
    assert index.resident("s") == {1, 2} and index.anomalies == 0


@pytest.mark.parametrize(
    ("keys", "lora", "expected"),
    [
        (None, None, (None, True)),
        (("tenant",), None, ("tenant", True)),
        (("my-lora", "tenant"), "my-lora", ("tenant", True)),
        (("my-lora",), "my-lora", (None, True)),
        (("a" * 64, "tenant"), None, ("tenant", True)),
        ((("img", 0), "tenant", b"\x01"), None, ("tenant", True)),
        (({"type": "cache_salt", "salt": "t"},), None, ("t", True)),
        ((("cache_salt", "t"),), None, ("t", True)),
        (("uuid-A", "salt"), "test-lora", (None, False)),
        ("not-a-list", None, (None, False)),
    ],
)
def test_salt_attribution(keys, lora, expected) -> None:
    found = salt_from_root_keys(keys, lora)
    assert (found.namespace, found.certain) == expected


def test_s1_events_without_extra_keys_are_uncertain() -> None:
    index = ShadowIndex()
    index.apply(BlockStored((1, 2), None, (), 2))
    assert index.uncertain() == {1, 2}
    index.apply(BlockRemoved((1, 2)))  # S1 removals carry no medium: the GPU copy goes
    assert len(index) == 0


def expected_state(frames_list: list[list[bytes]]) -> tuple[set[int], dict[int, str | None]]:
    """Independent reading of a 0.32 recording: resident set and each block's salt."""
    resident: set[int] = set()
    salt_of: dict[int, str | None] = {}
    for frames in frames_list:
        _, events = plain_decode(frames)
        for event in events:
            if event["type"] == "AllBlocksCleared":
                resident.clear()
            elif event["type"] == "BlockRemoved":
                resident -= {fold(h) for h in event["block_hashes"]}
            else:
                parent = event["parent_block_hash"]
                root_keys = event["extra_keys"][0]
                salt = salt_of[fold(parent)] if parent is not None else (root_keys or [None])[0]
                for h in event["block_hashes"]:
                    resident.add(fold(h))
                    salt_of[fold(h)] = salt
    return resident, {h: salt_of[h] for h in resident}


@pytest.mark.parametrize("run", RUNS, ids=lambda p: p.name)
def test_recorded_run_step_by_step(run) -> None:
    pub = kv_recording(run)["pub_frames"]
    index = ShadowIndex()
    for step, frames in enumerate(pub, start=1):
        for event in decode_message(frames).events:
            index.apply(event)
        index.check_integrity()
        resident, salts = expected_state(pub[:step])
        assert index.all_blocks() == resident, f"after seq {step - 1}"
        assert index.uncertain() == set()
        for namespace in set(salts.values()):
            assert index.resident(namespace) == {h for h, s in salts.items() if s == namespace}


def test_chain_keys_match_prompt_prefixes_only_in_their_namespace() -> None:
    """Routing's view: how many leading blocks of a prompt a rank holds, per namespace."""
    index = ShadowIndex()
    tokens = list(range(100, 100 + 3 * 32))
    index.apply(BlockStored((1, 2), None, tuple(tokens[:64]), 32,
                            extra_keys=(("tenant-a",), None)))
    index.apply(BlockStored((3,), 2, tuple(tokens[64:96]), 32, extra_keys=(None,)))
    index.check_integrity()
    assert index.prefix_blocks("tenant-a", [*tokens, 7], 32) == 3
    assert index.prefix_blocks("tenant-a", tokens[:40], 32) == 1
    assert index.prefix_blocks("tenant-b", tokens, 32) == 0  # same tokens, other tenant
    assert index.prefix_blocks(None, tokens, 32) == 0
    assert index.prefix_blocks("tenant-a", [0, *tokens[1:]], 32) == 0
    index.apply(BlockRemoved((2,), "GPU"))  # block 2 leaves: the chain stops before it
    index.check_integrity()
    assert index.prefix_blocks("tenant-a", tokens, 32) == 1
    unknown_parent = ShadowIndex()
    unknown_parent.apply(BlockStored((9,), 404, tuple(tokens[:32]), 32, extra_keys=(None,)))
    assert unknown_parent.prefix_blocks("tenant-a", tokens, 32) == 0


@given(tokens=st.lists(st.integers(0, 2**32 - 1), max_size=200), block_size=st.integers(1, 64),
       namespace=st.none() | st.text(max_size=8))
def test_a_prompt_chain_is_each_block_keyed_after_its_parent(
        tokens: list[int], block_size: int, namespace: str | None) -> None:
    """The router's packed chain equals the keys the index gives stored blocks."""
    expected, key = [], namespace_root(namespace)
    for start in range(0, len(tokens) - block_size + 1, block_size):
        key = chain_key(key, tokens[start:start + block_size])
        expected.append(key)
    assert prompt_chain(namespace, tokens, block_size) == expected
