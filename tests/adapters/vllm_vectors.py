"""Recorded vLLM 0.32.0 traffic (../shared/vectors, beside the repository)."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import msgpack

VECTORS = Path(__file__).resolve().parents[3] / "shared" / "vectors"
INT_RUN = VECTORS / "vllm-0.32.0-cpu"
BYTES_RUN = VECTORS / "vllm-0.32.0-cpu-bytes-hashes-bs32"
RUNS = (INT_RUN, BYTES_RUN)


def kv_recording(run: Path) -> dict[str, Any]:
    """kv_frames.json with every base64 frame decoded to bytes."""
    raw = json.loads((run / "kv_frames.json").read_text())
    return {
        "pub_frames": [[base64.b64decode(f) for f in msg] for msg in raw["pub_frames"]],
        "replay_request": [base64.b64decode(f) for f in raw["replay_request"]],
        "replay_reply_frames": [
            [base64.b64decode(f) for f in m] for m in raw["replay_reply_frames"]
        ],
    }


def plain_decode(frames: list[bytes]) -> tuple[int, list[dict[str, Any]]]:
    """(seq, events as maps) straight from msgpack: the independent view tests compare with."""
    batch = msgpack.unpackb(frames[2], raw=False, strict_map_key=False)
    return int.from_bytes(frames[1], "big"), batch[1]


def fold(value: int | bytes) -> int:
    return int.from_bytes(value[-8:], "big") if isinstance(value, bytes) else value


def http_records(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "http.jsonl").read_text().splitlines() if line]
