"""KV-event decoding: oracle cases 0, 1, 3 of docs/reference/vllm-surfaces.md §2.9, recorded
frames, fuzz."""

from __future__ import annotations

import contextlib
import hashlib

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.vllm.kv_decode import (
    KVDecodeError,
    decode_event,
    decode_message,
    decode_payload,
    decode_replay_reply,
    fold_hash,
)
from schemas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from tests.adapters.vllm_vectors import RUNS, fold, kv_recording, plain_decode

KTHENA_HASH = 15760518052499183552


def test_oracle0_array_and_map_decode_identically() -> None:
    array = ["BlockStored", [KTHENA_HASH], None, [1, 2], 2, None, "GPU"]
    mapped = {
        "type": "BlockStored",
        "block_hashes": [KTHENA_HASH],
        "parent_block_hash": None,
        "token_ids": [1, 2],
        "block_size": 2,
        "medium": "GPU",
    }
    assert decode_event(array) == decode_event(mapped)
    assert decode_event(mapped).block_hashes == (KTHENA_HASH,)


def test_oracle0_kthena_v026_fixture() -> None:
    tokens = list(range(100, 116))
    payload = msgpack.packb(
        [
            1789095808.8378847,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [KTHENA_HASH],
                    "parent_block_hash": None,
                    "token_ids": tokens,
                    "block_size": 16,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                    "extra_keys": [None],
                    "group_idx": 0,
                    "kv_cache_spec_kind": "full_attention",
                }
            ],
            0,
        ]
    )
    batch = decode_payload(payload, seq=7)
    assert (batch.seq, batch.ts, batch.dp_rank) == (7, 1789095808.8378847, 0)
    (event,) = batch.events
    assert event == BlockStored(
        block_hashes=(KTHENA_HASH,),
        parent_block_hash=None,
        token_ids=tuple(tokens),
        block_size=16,
        medium="GPU",
        extra_keys=(None,),
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )
    assert event.block_hashes[0] > 2**63


def test_oracle1_llmd_positional_vector() -> None:
    event = decode_event(
        [
            "BlockStored",
            [200, 201],
            199,
            [4, 5, 6],
            32,
            42,
            "gpu",
            "test-lora",
            [["uuid-A", "salt"], None],
        ]
    )
    assert event == BlockStored(
        block_hashes=(200, 201),
        parent_block_hash=199,
        token_ids=(4, 5, 6),
        block_size=32,
        lora_id=42,
        medium="gpu",
        lora_name="test-lora",
        extra_keys=(("uuid-A", "salt"), None),
    )


def test_oracle1_short_and_long_arrays() -> None:
    short = decode_event(["BlockStored", [11], None, [10, 11], 2])
    assert short == BlockStored(
        block_hashes=(11,), parent_block_hash=None, token_ids=(10, 11), block_size=2
    )
    long = [
        "BlockStored",
        [11],
        None,
        [10, 11],
        2,
        None,
        "GPU",
        None,
        [None],
        0,
        "full_attention",
        None,
        "unknown-trailing",
    ]
    assert decode_event(long).kv_cache_spec_kind == "full_attention"
    assert decode_event(["BlockRemoved", [5], "GPU", 0, "extra"]) == BlockRemoved((5,), "GPU", 0)
    assert decode_event({"type": "BlockRemoved", "block_hashes": [5], "future": 1}) == BlockRemoved(
        (5,)
    )


def test_oracle3_bytes_hash_folds_like_int_mode() -> None:
    digest = hashlib.sha256(b"block").digest()
    as_int = int.from_bytes(digest, "big") & (2**64 - 1)
    assert fold_hash(digest) == as_int
    assert decode_event(["BlockRemoved", [digest]]) == decode_event(["BlockRemoved", [as_int]])


def test_s1_synthetic_bytes_and_negative_hashes() -> None:
    payload = (
        bytes.fromhex("92cb3ff80000000000009196ab")
        + b"BlockStored"
        + bytes.fromhex("926fccdec0940102030402c0")
    )
    batch = decode_payload(payload, seq=0)
    assert batch.ts == 1.5 and batch.dp_rank == 0
    assert batch.events == (BlockStored((111, 222), None, (1, 2, 3, 4), 2),)
    assert fold_hash(-1) == 2**64 - 1
    assert decode_event(["BlockRemoved", [-2]]).block_hashes == (2**64 - 2,)


def test_cleared_batch_and_outer_map() -> None:
    assert decode_payload(msgpack.packb([0.0, [["AllBlocksCleared"]], 0]), 3).events == (
        AllBlocksCleared(),
    )
    batch = decode_payload(
        msgpack.packb({"ts": 2, "events": [{"type": "AllBlocksCleared"}], "data_parallel_rank": 1}),
        4,
    )
    assert (batch.ts, batch.dp_rank, batch.events) == (2.0, 1, (AllBlocksCleared(),))


@pytest.mark.parametrize(
    "bad",
    [
        ["BlockStored", [1], None, [1]],  # too short
        ["Nope", [1]],
        {"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": 0},
        {"type": "BlockStored", "block_hashes": [True], "token_ids": [], "block_size": 1},
        {"type": "BlockStored", "block_hashes": [1], "token_ids": [1, True], "block_size": 1},
        {"type": "BlockStored", "block_hashes": [1], "token_ids": [1, 2.0], "block_size": 1},
        {"type": "BlockStored", "block_hashes": [1], "token_ids": (1, 2), "block_size": 1},
        {"type": "BlockRemoved", "block_hashes": [b""]},
        {"type": "BlockRemoved", "block_hashes": ["x"]},
        {"block_hashes": [1]},
        [],
        7,
    ],
)
def test_malformed_events_raise_the_decode_error(bad: object) -> None:
    with pytest.raises(KVDecodeError):
        decode_event(bad)


@pytest.mark.parametrize("run", RUNS, ids=lambda p: p.name)
def test_recorded_frames_decode_and_match_plain_msgpack(run) -> None:
    recording = kv_recording(run)
    for frames in recording["pub_frames"]:
        batch = decode_message(frames)
        seq, raw_events = plain_decode(frames)
        assert batch.seq == seq and len(batch.events) == len(raw_events)
        for event, raw in zip(batch.events, raw_events, strict=True):
            assert type(event).__name__ == raw["type"]
            if "block_hashes" in raw:
                assert event.block_hashes == tuple(fold(h) for h in raw["block_hashes"])
    replies = [decode_replay_reply(f) for f in recording["replay_reply_frames"]]
    assert replies[-1] is None and all(r is not None for r in replies[:-1])
    assert [r.seq for r in replies[:-1]] == list(range(len(replies) - 1))


def test_replay_reply_old_and_new_shapes() -> None:
    payload = msgpack.packb([1.0, [["AllBlocksCleared"]], 0])
    seq = (5).to_bytes(8, "big")
    assert decode_replay_reply([b"", seq, payload]).seq == 5  # ≤ v0.25
    assert decode_replay_reply([b"", b"kv", seq, payload]).seq == 5  # ≥ v0.26
    assert decode_replay_reply([b"", b"\xff" * 8, b""]) is None
    assert decode_replay_reply([b"", b"", b"\xff" * 8, b""]) is None
    with pytest.raises(KVDecodeError):
        decode_replay_reply([b"", b"a", b"b", b"c", b"d"])


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=256))
def test_fuzz_garbage_payload(garbage: bytes) -> None:
    try:
        batch = decode_payload(garbage, 0)
    except KVDecodeError:
        return
    assert batch.seq == 0


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=40)
    | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type"]),
    lambda inner: (
        st.lists(inner, max_size=6)
        | st.dictionaries(
            st.text(max_size=6)
            | st.sampled_from(
                ["type", "block_hashes", "token_ids", "block_size", "events", "extra_keys"]
            ),
            inner,
            max_size=6,
        )
    ),
    max_leaves=30,
)


@settings(max_examples=200, deadline=None)
@given(msgpack_values, st.lists(st.binary(max_size=12), max_size=4))
def test_fuzz_structured_garbage(value: object, frames: list[bytes]) -> None:
    for candidate in ([b"kv", (1).to_bytes(8, "big"), msgpack.packb(value)], frames):
        with contextlib.suppress(KVDecodeError):
            decode_message(candidate)
