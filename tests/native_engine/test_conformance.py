"""Conformance: every request of the recorded vLLM 0.32.0 run, replayed in order against
`fak engine serve` (sized like that server: 24 blocks of 128 tokens), answers with the same
status, the same keys and the same value types (text may differ); the recorded edge cases
get the same error `type` and `param`, and a chat stream the same chunk shapes."""

from __future__ import annotations

import ast
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio

from native_engine.serve.server import RunningServer, ServerConfig, start_server

from ..conftest import VECTORS

pytestmark = pytest.mark.slow

RUN = VECTORS / "vllm-0.32.0-cpu"


def shape(value: Any) -> Any:
    """Keys and value types, recursively; the values themselves are dropped."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(v) for v in value]
    return type(value).__name__


def recorded_http() -> list[dict[str, Any]]:
    return [json.loads(line) for line in (RUN / "http.jsonl").read_text().splitlines() if line]


def recorded_edge_cases() -> dict[str, Any]:
    """name -> what vLLM answered: (status, ..., error) tuples, `status json` lines, or the
    list of SSE data lines of one chat stream."""
    cases: dict[str, Any] = {"SSE": []}
    for line in (RUN / "http_edge_cases.txt").read_text().splitlines():
        if line.startswith("SSE data: "):
            cases["SSE"].append(line[len("SSE data: "):])
        elif " (" in line and line.endswith(")"):
            name, _, rest = line.partition(" (")
            cases[name] = ast.literal_eval("(" + rest)
        else:
            name, status, body = line.split(" ", 2)
            cases[name] = (int(status), json.loads(body))
    return cases


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server() -> AsyncIterator[RunningServer]:
    config = ServerConfig(port=0, block_size=128, num_blocks=24, max_model_len=2048,
                          enable_prompt_tokens_details=True, scheduling_policy="priority",
                          dev_mode=True, attention_backend="torch", device="cpu")
    running = await start_server(config)
    yield running
    await running.close()


@pytest.mark.asyncio(loop_scope="module")
async def test_every_recorded_request_has_vllms_shape(server: RunningServer) -> None:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=600) as client:
        for i, record in enumerate(recorded_http()):
            if "request" in record:
                r = await client.post(record["path"], json=record["request"])
                got = r.json()
            else:
                r = await client.post(record["path"])
                got, record = r.json(), {**record, "response": json.loads(record["response"])}
            assert r.status_code == record["status"], (i, r.text)
            assert shape(got) == shape(record["response"]), (i, record["path"])


ERROR_CASES = {
    "bad salt empty": {"cache_salt": ""},
    "bad salt slash": {"cache_salt": "a/b"},
    "bad salt long": {"cache_salt": "x" * 200},
    "prio str": {"priority": "high"},
    "badmodel": {"model": "nope"},
}


@pytest.mark.asyncio(loop_scope="module")
async def test_recorded_faults_get_the_same_status_type_and_param(server: RunningServer) -> None:
    cases = recorded_edge_cases()
    base = {"model": "smollm2", "prompt": "a b c", "max_tokens": 1, "temperature": 0}
    async with httpx.AsyncClient(base_url=server.base_url, timeout=600) as client:
        for name, extra in ERROR_CASES.items():
            r = await client.post("/v1/completions", json={**base, **extra})
            want = cases[name]
            status, error = (want[0], want[1]["error"]) if name == "badmodel" else (want[0],
                                                                                     want[4])
            got = r.json()
            assert r.status_code == status, name
            assert shape(got) == shape({"error": error}), name
            assert (got["error"]["type"], got["error"]["param"]) == (error["type"],
                                                                     error["param"]), name
        r = await client.post("/v1/completions", content=b"{bad",
                              headers={"content-type": "application/json"})
        status, body = cases["badjson"]
        assert r.status_code == status and shape(r.json()) == shape(body)
        assert r.json()["error"]["param"] == body["error"]["param"]
        for priority in (5, -5):  # accepted under --scheduling-policy priority
            r = await client.post("/v1/completions", json={**base, "priority": priority})
            assert r.status_code == 200


@pytest.mark.asyncio(loop_scope="module")
async def test_chat_stream_chunks_have_vllms_shape(server: RunningServer) -> None:
    recorded = recorded_edge_cases()["SSE"]
    whole = [json.loads(d) for d in recorded if d != "[DONE]" and d.endswith("}")]
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    got: list[Any] = []
    async with (httpx.AsyncClient(base_url=server.base_url, timeout=600) as client,
                client.stream("POST", "/v1/chat/completions", json=body) as r):
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                got.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    assert got[-1] == "[DONE]" and recorded[-1] == "[DONE]"
    assert shape(got[0]) == shape(whole[0])  # the role chunk
    assert shape(got[1]) == shape(whole[1])  # a content chunk
    assert shape(got[-3]) == shape(whole[-1])  # the finishing chunk
    usage = got[-2]
    assert usage["choices"] == [] and shape(usage["usage"]["prompt_tokens_details"]) == {
        "cached_tokens": "int", "created_cache_tokens": "int"}
