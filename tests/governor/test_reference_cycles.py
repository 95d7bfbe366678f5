"""A request's hot path leaves no reference cycles (issue 19).

Garbage in a cycle is freed only by the collector: one small cycle per request (a recursive
closure in the salt scan) made most of the governor's young collections at line rate, each
a pause that walks every request in flight. What a request allocates on the way through
the checks, the forwarded body, the answer's decoding and the engine's KV events must be
freed by reference counting alone: with the collector off, a full collection afterwards
finds nothing.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from adapters.vllm.http_driver import forwarded_bytes
from adapters.vllm.kv_decode import decode_message
from adapters.vllm.sse import SSEFramer, chunk_from_body, chunk_from_event_data
from governor.pipeline import PipelineInputs, prepare
from policies.request_fields import FieldRules
from policies.salts import find_client_salts, strip_client_salts
from schemas.engine import EngineCapabilities
from schemas.openai import Route, load_json
from tests.adapters.vllm_vectors import RUNS, kv_recording

CAPS = EngineCapabilities(engine_kind="vllm", model_id="smollm2", cache_salt=True)
BODIES: list[tuple[Route, dict[str, Any]]] = [
    ("completions", {"model": "smollm2", "prompt": "Say hello.", "max_tokens": 1,
                     "temperature": 0}),
    ("chat", {"messages": [{"role": "system", "content": "Be brief."},
                           {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
              "stream": True, "stream_options": {"include_usage": False}, "seed": 7}),
]
SALTED = {"prompt": "x", "nvext": {"cache_salt": "mine", "deep": [{"extra_key": 1}]},
          "extra_body": {"Cache_Salt_Id": "a"}}
ANSWER = json.dumps({"id": "cmpl-1", "object": "text_completion", "choices": [
    {"index": 0, "text": " hi", "finish_reason": "length"}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6,
              "prompt_tokens_details": {"cached_tokens": 0}}}).encode()


@pytest.fixture
def collector_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def cycles_left_by(step: Callable[[], object], times: int = 50) -> int:
    """What a full collection finds after `times` steps (a first step warms caches and
    lazy imports, whose objects may live in cycles for good)."""
    step()
    gc.collect()
    for _ in range(times):
        step()
    return gc.collect()


@pytest.mark.parametrize("policy", ["reject", "strip"])
def test_the_checks_and_the_forwarded_body(collector_off: None, policy: str) -> None:
    pipeline = PipelineInputs(FieldRules(), 64, policy)

    def one_request() -> None:
        for route, body in BODIES:
            raw = json.dumps(body).encode()
            prepared = prepare(route, load_json(raw), pipeline, CAPS, "acme", "req-1",
                               "fak1-salt", None, len(raw))
            forwarded_bytes(prepared.request, True, CAPS.model_id)

    assert cycles_left_by(one_request) == 0


def test_the_salt_scan(collector_off: None) -> None:
    def scans() -> None:
        assert len(find_client_salts(SALTED)) == 3
        assert len(strip_client_salts(SALTED)[1]) == 3

    assert cycles_left_by(scans) == 0


def test_the_answer_and_stream_decoding(collector_off: None) -> None:
    event = b"data: " + ANSWER + b"\n\ndata: [DONE]\n\n"

    def decode() -> None:
        chunk_from_body(ANSWER)
        framer = SSEFramer()
        for sse in framer.feed(event[:40]) + framer.feed(event[40:]) + framer.close():
            chunk_from_event_data(sse.data)

    assert cycles_left_by(decode) == 0


@pytest.mark.parametrize("run", RUNS, ids=lambda run: run.name)
def test_kv_event_decoding(collector_off: None, run: Path) -> None:
    messages = kv_recording(run)["pub_frames"]

    def decode() -> None:
        for frames in messages:
            decode_message(frames)

    assert cycles_left_by(decode) == 0
