"""`fak engine serve` stays up for everyone (issue 11), on loopback, faults injected into the
real engine it serves: a `temperature: 1e-45` request, a request that fails in the engine,
a crashed loop (restarted: /health 503 then 200) and a crash loop (dead: /health 503 saying
why), each while another client streams. Mechanics on the tiny random model exported as an HF
directory; the 1e-45 request once more on the real SmolLM2 (slow)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from native_engine.async_engine import SupervisorConfig
from native_engine.engine import LLMEngine
from native_engine.model.export_hf import export_model
from native_engine.serve.server import RunningServer, ServerConfig, start_server
from tests.native_engine.tiny_model import random_model

TOKENS = 200  # the other client's stream: long enough to run throughout each probe
Starter = Callable[..., Awaitable[RunningServer]]


class InjectedFault(RuntimeError):
    pass


def fail_always(*args: object) -> None:
    raise InjectedFault("injected")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-hf")
    export_model(random_model(seed=3), path)
    return path


async def started(model: Path | None, **over: Any) -> RunningServer:
    base: dict[str, Any] = dict(port=0, block_size=4, num_blocks=256, max_model_len=512,
                                attention_backend="torch", device="cpu", dtype="float32")
    if model is not None:
        base.update(model=str(model), served_model_name="tiny")
    return await start_server(ServerConfig(**{**base, **over}))


@pytest.fixture
async def tiny(tiny_dir: Path) -> AsyncIterator[Callable[..., Awaitable[RunningServer]]]:
    """Start the tiny model's server with a given supervisor; closed after the test."""
    servers: list[RunningServer] = []

    async def start(**supervisor: float) -> RunningServer:
        servers.append(await started(tiny_dir, supervisor=SupervisorConfig(**supervisor)))
        return servers[-1]

    yield start
    for running in servers:
        await running.close()


def chat(n: int = TOKENS, **over: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": n,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **over}


async def sse(client: httpx.AsyncClient, body: dict[str, Any], started: asyncio.Event | None
              = None, headers: dict[str, str] | None = None) -> list[Any]:
    events: list[Any] = []
    async with client.stream("POST", "/v1/chat/completions", json=body,
                             headers=headers) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
                if started is not None:
                    started.set()
    return events


def assert_complete(events: list[Any], n: int = TOKENS) -> None:
    """A whole stream: [DONE] last, the usage chunk before it with exactly `n` tokens."""
    assert events[-1] == "[DONE]"
    assert not any("error" in e for e in events[:-1] if isinstance(e, dict))
    assert events[-2]["usage"]["completion_tokens"] == n
    assert events[-3]["choices"][0]["finish_reason"] == "length"


def assert_error_then_done(events: list[Any], status: int) -> None:
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert "Traceback" not in error["message"] and "InjectedFault" not in error["message"]


async def other_stream(client: httpx.AsyncClient, n: int = TOKENS) -> asyncio.Task:
    """Another client's stream, once it has begun."""
    begun = asyncio.Event()
    task = asyncio.create_task(sse(client, chat(n), begun))
    await asyncio.wait_for(begun.wait(), 60)
    return task


async def health(client: httpx.AsyncClient) -> httpx.Response:
    return await client.get("/health")


async def wait_health(client: httpx.AsyncClient, status: int) -> httpx.Response:
    for _ in range(300):
        r = await health(client)
        if r.status_code == status:
            return r
        await asyncio.sleep(0.02)
    raise AssertionError(f"/health never answered {status}")


async def sub_epsilon_while_another_streams(running: RunningServer, prompt: str,
                                            n: int) -> None:
    """The issue's request: it used to kill the engine loop for every tenant."""
    async with httpx.AsyncClient(base_url=running.base_url, timeout=300) as c:
        body = {"prompt": prompt, "max_tokens": 6, "ignore_eos": True}
        greedy = (await c.post("/v1/completions", json={**body, "temperature": 0})).json()
        other = await other_stream(c, n)
        r = await c.post("/v1/completions", json={**body, "temperature": 1e-45})
        assert r.status_code == 200, r.text
        assert not other.done()
        # Below vLLM's sampling epsilon is greedy: the same answer as temperature 0.
        assert r.json()["choices"][0]["text"] == greedy["choices"][0]["text"]
        assert_complete(await other, n)
        assert (await health(c)).status_code == 200


async def test_sub_epsilon_temperature_is_greedy_and_hurts_nobody(tiny: Starter) -> None:
    await sub_epsilon_while_another_streams(await tiny(), "Once upon a time", TOKENS)


@pytest.mark.slow
async def test_sub_epsilon_temperature_on_the_real_model() -> None:
    running = await started(None, block_size=16, num_blocks=64, dtype="auto")
    try:
        await sub_epsilon_while_another_streams(running, "The capital of France is", 48)
    finally:
        await running.close()


async def test_a_request_failing_in_the_engine_ends_alone(
        tiny: Starter, monkeypatch: pytest.MonkeyPatch) -> None:
    running = await tiny()
    llm: LLMEngine = running.llm_engine
    real = llm._check_stop_token

    def faulty(req, token):
        if req.request_id.startswith("victim") and req.num_output_tokens == 3:
            raise InjectedFault("stop check")
        return real(req, token)

    monkeypatch.setattr(llm, "_check_stop_token", faulty)
    victim = {"X-Request-Id": "victim"}
    async with httpx.AsyncClient(base_url=running.base_url, timeout=120) as c:
        other = await other_stream(c)
        streamed = await sse(c, chat(), headers=victim)  # started, so an error event
        assert streamed[0]["choices"][0]["delta"]["role"] == "assistant"
        assert_error_then_done(streamed, 500)
        whole = await c.post("/v1/chat/completions", json=chat(stream=False,
                                                              stream_options=None),
                             headers=victim)
        assert whole.status_code == 500
        assert whole.json()["error"]["type"] == "InternalServerError"
        assert not other.done()
        assert_complete(await other)
        assert (await health(c)).status_code == 200
        assert_complete(await sse(c, chat(8)), 8)
    await running.engine.call(lambda e: e.check_integrity())


async def test_a_crashed_loop_restarts_and_health_tells(
        tiny: Starter, monkeypatch: pytest.MonkeyPatch) -> None:
    running = await tiny(backoff_s=1.0)
    async with httpx.AsyncClient(base_url=running.base_url, timeout=120) as c:
        assert (await health(c)).status_code == 200
        inflight = await other_stream(c)
        # A fault in this scheduler object; the restarted loop rebuilds a fresh one.
        monkeypatch.setattr(running.llm_engine.scheduler, "schedule", fail_always)
        assert_error_then_done(await inflight, 500)
        r = await health(c)
        assert r.status_code == 503
        assert r.json()["status"] == "restarting" and "InjectedFault" in r.json()["reason"]
        later = asyncio.create_task(sse(c, chat(8)))  # sent while restarting: it waits
        await wait_health(c, 200)
        assert_complete(await later, 8)
        assert running.engine.liveness().restarts == 1


async def test_a_crash_loop_ends_dead_and_health_says_so(
        tiny: Starter, monkeypatch: pytest.MonkeyPatch) -> None:
    running = await tiny(max_restarts=1, backoff_s=0.05)
    monkeypatch.setattr(running.llm_engine.scheduler, "schedule", fail_always)
    monkeypatch.setattr(running.llm_engine, "rebuild", fail_always)  # each restart crashes
    async with httpx.AsyncClient(base_url=running.base_url, timeout=120) as c:
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 500 and r.json()["error"]["type"] == "InternalServerError"
        r = await wait_health(c, 503)
        for _ in range(300):
            if r.json()["status"] == "dead":
                break
            await asyncio.sleep(0.02)
            r = await health(c)
        assert r.status_code == 503 and r.json()["status"] == "dead"
        assert r.json()["restarts"] == 1 and "InjectedFault" in r.json()["reason"]
        r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"
        assert (await c.get("/metrics")).status_code == 200
        assert (await health(c)).status_code == 503
