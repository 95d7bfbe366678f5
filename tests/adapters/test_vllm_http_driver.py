"""VLLMDriver over real loopback sockets: a vLLM 0.32.0 imitation, a server answering canned
malformed responses, a listener whose backlog is full (a connect that never completes)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
import threading
import time
from typing import Any

import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from adapters.driver import EngineDriver
from adapters.vllm import http_driver
from adapters.vllm.http_driver import VLLMDriver, VLLMHTTPConfig, encode_body
from adapters.vllm.upstream_errors import EngineNotReached
from adapters.vllm.urls import PUBLIC_SURFACES
from schemas.engine import OFF_LOOP_BYTES, EngineCapabilities, EngineError, EngineRequest
from tests.adapters.vllm_imitation import (
    SALT_RULE,
    SSE_LINES,
    Imitation,
    serve_app,
    start_imitation,
)
from tests.adapters.vllm_vectors import INT_RUN, http_records

CAPS = EngineCapabilities(engine_kind="vllm", model_id="smollm2", cache_salt=True)


@contextlib.asynccontextmanager
async def running(state: Imitation, caps: EngineCapabilities | None = CAPS, **config):
    runner, base_url = await start_imitation(state)
    driver = VLLMDriver(VLLMHTTPConfig(base_url=base_url, **config), capabilities=caps)
    await driver.start()
    try:
        yield driver
    finally:
        await driver.close()
        await runner.cleanup()


async def collect(driver: VLLMDriver, request: EngineRequest) -> list:
    return [chunk async for chunk in driver.generate(request)]


def req(
    body: dict, salt: str | None = "tenant-a", *, route="completions", stream=False, priority=None
):
    return EngineRequest.of("r-1", route, {**body, "stream": stream}, "tenant", salt,
                            priority=priority)


@pytest.fixture
def state() -> Imitation:
    return Imitation()


async def test_is_an_engine_driver(state) -> None:
    async with running(state) as driver:
        assert isinstance(driver, EngineDriver)
        assert await driver.ready()
        assert (await driver.models())["data"][0]["id"] == "smollm2"


async def test_replays_the_recorded_run_with_salts_and_usage(state) -> None:
    records = [r for r in http_records(INT_RUN) if "request" in r]
    async with running(state) as driver:
        for record in records:
            body = {k: v for k, v in record["request"].items() if k != "cache_salt"}
            salt = record["request"].get("cache_salt", "fak1-unsalted-probe")
            route = "chat" if record["path"].endswith("chat/completions") else "completions"
            request = req(body, salt, route=route)
            if "cache_salt" not in record["request"]:
                state.recorded[
                    json.dumps([record["path"], body.get("prompt"), body.get("messages"), salt])
                ] = [record]
            (chunk,) = await collect(driver, request)
            assert chunk.data == record["response"]
            details = record["response"]["usage"]["prompt_tokens_details"]
            assert chunk.usage.cached_tokens == details["cached_tokens"]
            assert chunk.usage.prompt_tokens == record["response"]["usage"]["prompt_tokens"]
    generation = [r for r in state.received if r[0] == "POST"]
    assert len(generation) == len(records)
    assert all(body["cache_salt"] and body["stream"] is False for _, _, _, body in generation)
    assert all(headers["x-request-id"] == "r-1" for _, _, headers, _ in generation)
    assert {(m, p) for m, p, _, _ in state.received} <= PUBLIC_SURFACES


async def test_salt_is_ours_and_priority_only_when_declared(state) -> None:
    record = next(
        r for r in http_records(INT_RUN) if r.get("request", {}).get("cache_salt") == "tenant-b"
    )
    body = {**record["request"], "cache_salt": "client-chosen", "priority": -100}
    async with running(state) as driver:
        await collect(driver, req(body, "tenant-b", priority=3))
    sent = state.received[-1][3]
    assert sent["cache_salt"] == "tenant-b" and "priority" not in sent
    state.recorded.clear()
    prio_state = Imitation()
    caps = EngineCapabilities(
        engine_kind="vllm", model_id="smollm2", cache_salt=True, priority_scheduling=True
    )
    async with running(prio_state, caps) as driver:
        await collect(driver, req(body, "tenant-b", priority=3))
    assert prio_state.received[-1][3]["priority"] == 3


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 80), 1 << 80)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner, max_size=5),
    max_leaves=30)


@given(st.dictionaries(st.text(), JSON_VALUES, max_size=6))
def test_the_encoded_body_reads_back_as_the_same_values(body: dict[str, Any]) -> None:
    """orjson where it can, the standard library past 64-bit integers: the same values."""
    assert json.loads(encode_body(body)) == body


async def test_a_large_body_is_encoded_off_the_loop_to_the_same_bytes(state, monkeypatch) -> None:
    threads: list[int] = []
    encode = http_driver.forwarded_bytes

    def recorded(*args: Any) -> bytes:
        threads.append(threading.get_ident())
        return encode(*args)

    monkeypatch.setattr(http_driver, "forwarded_bytes", recorded)
    small = req({"model": "smollm2", "prompt": [11] * 3000, "max_tokens": 1})
    large = dataclasses.replace(small, body_bytes=OFF_LOOP_BYTES)
    async with running(state) as driver:
        await collect(driver, small)
        await collect(driver, large)
    assert threads[0] == threading.get_ident() != threads[1]
    assert state.received[-1][3] == state.received[-2][3]
    assert state.received[-1][3]["prompt"] == [11] * 3000


async def test_request_without_salt_is_refused_before_sending(state) -> None:
    async with running(state) as driver:
        with pytest.raises(EngineError) as err:
            await collect(driver, req({"model": "smollm2", "prompt": "x"}, salt=None))
    assert err.value.status == 500 and state.received == []


async def test_chat_stream_relayed_chunk_for_chunk(state) -> None:
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "stream_options": {"include_usage": True},
    }
    async with running(state) as driver:
        chunks = await collect(driver, req(body, route="chat", stream=True))
    expected = [line[len("data: ") :] for line in SSE_LINES]
    assert [c.data for c in chunks[:-1]] == [json.loads(x) for x in expected[:-1]]
    assert chunks[-1].done and chunks[-1].data is None and expected[-1] == "[DONE]"
    assert chunks[0].data["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    usage_chunks = [c for c in chunks if c.usage]
    assert len(usage_chunks) == 1 and usage_chunks[0].data["choices"] == []
    assert (usage_chunks[0].usage.prompt_tokens, usage_chunks[0].usage.cached_tokens) == (31, 0)
    assert state.received[-1][3]["stream"] is True


async def test_connections_are_kept_alive_after_answers_and_streams() -> None:
    """Even when the body's end comes a little after [DONE], as it can from vLLM."""
    state = Imitation(end_delay_s=0.05)
    chat = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]}
    async with running(state) as driver:
        for _ in range(2):
            await collect(driver, req({"model": "smollm2", "prompt": "x"}))
            chunks = await collect(driver, req(chat, route="chat", stream=True))
            assert chunks[-1].done
    assert len(state.peers) == 4 and len(set(state.peers)) == 1


@pytest.mark.parametrize("flat", [False, True], ids=["nested-error", "pre-0.10.1-flat"])
async def test_upstream_errors_pass_through(flat: bool) -> None:
    state = Imitation(flat_errors=flat)
    async with running(state) as driver:
        with pytest.raises(EngineError) as err:
            await collect(driver, req({"model": "smollm2", "prompt": "x"}, salt="a/b"))
    assert (err.value.status, err.value.type, err.value.param) == (
        400,
        "BadRequestError",
        "cache_salt",
    )
    assert err.value.message == SALT_RULE


async def test_unknown_model_is_a_404(state) -> None:
    async with running(state) as driver:
        with pytest.raises(EngineError) as err:
            await collect(driver, req({"model": "nope", "prompt": "x"}))
    assert (err.value.status, err.value.type) == (404, "NotFoundError")
    assert "does not exist" in err.value.message


async def test_refused_connection_is_a_502() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    driver = VLLMDriver(VLLMHTTPConfig(base_url=f"http://127.0.0.1:{port}"), capabilities=CAPS)
    await driver.start()
    try:
        with pytest.raises(EngineError) as err:
            await collect(driver, req({"model": "smollm2", "prompt": "x"}))
        assert err.value.status == 502 and isinstance(err.value, EngineNotReached)
        assert not await driver.ready()
    finally:
        await driver.close()


@pytest.mark.slow
async def test_first_byte_timeout_is_a_504() -> None:
    state = Imitation(head_delay_s=1.0)
    async with running(state, first_byte_timeout_s=0.2, total_timeout_s=5.0) as driver:
        with pytest.raises(EngineError) as err:
            await collect(driver, req({"model": "smollm2", "prompt": "x"}))
    assert err.value.status == 504


@pytest.mark.slow
async def test_a_whole_answer_whose_body_is_late_is_a_504() -> None:
    """The head and half the body come at once, the rest after the deadline: the deadline
    covers the body's reads too."""
    answer = b'{"choices":[{"text":"hi"}],"usage":{"prompt_tokens":1,"completion_tokens":1}}'

    async def trickle(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json",
                                               "Content-Length": str(len(answer))})
        await response.prepare(request)
        await response.write(answer[:10])
        await asyncio.sleep(2.0)
        await response.write(answer[10:])
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", trickle)
    runner, base_url = await serve_app(app)
    driver = VLLMDriver(VLLMHTTPConfig(base_url=base_url, first_byte_timeout_s=0.4,
                                       total_timeout_s=5.0), capabilities=CAPS)
    await driver.start()
    try:
        started = time.monotonic()
        with pytest.raises(EngineError) as err:
            await collect(driver, req({"model": "smollm2", "prompt": "x"}))
        took = time.monotonic() - started
    finally:
        await driver.close()
        await runner.cleanup()
    assert (err.value.status, err.value.message) == (
        504, "engine timed out: no answer within the configured timeout")
    assert 0.3 < took < 1.5, took


@pytest.mark.slow
async def test_a_stream_whose_first_event_is_late_is_a_504() -> None:
    """The head came at once; no event by the first-byte deadline."""
    state = Imitation(first_event_delay_s=2.0)
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]}
    async with running(state, first_byte_timeout_s=0.3, total_timeout_s=5.0) as driver:
        started = time.monotonic()
        with pytest.raises(EngineError) as err:
            await collect(driver, req(body, route="chat", stream=True))
        took = time.monotonic() - started
    assert err.value.status == 504 and took < 1.5, took


@pytest.mark.slow
async def test_total_timeout_is_a_504_mid_stream() -> None:
    state = Imitation(stream_delay_s=0.3)
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]}
    async with running(state, first_byte_timeout_s=0.5, total_timeout_s=0.5) as driver:
        got = []
        with pytest.raises(EngineError) as err:
            async for chunk in driver.generate(req(body, route="chat", stream=True)):
                got.append(chunk)
    assert err.value.status == 504 and 0 < len(got) < len(SSE_LINES)


@pytest.mark.slow
async def test_client_disconnect_closes_the_upstream_stream() -> None:
    state = Imitation(stream_delay_s=0.2)
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]}
    async with running(state) as driver:
        stream = driver.generate(req(body, route="chat", stream=True))
        assert (await anext(stream)).data["object"] == "chat.completion.chunk"
        await stream.aclose()
        await asyncio.wait_for(state.disconnected.wait(), timeout=3.0)


@contextlib.contextmanager
def unaccepting_listener(port: int = 0):
    """A loopback port (`port`, else a free one) whose accept queue is full: further
    connects hang in SYN_SENT."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a server's old port
    listener.bind(("127.0.0.1", port))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(8):
        filler = socket.socket()
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect(("127.0.0.1", port))
        fillers.append(filler)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        for sock in (*fillers, listener):
            sock.close()


async def test_connect_timeout_is_a_504() -> None:
    with unaccepting_listener() as base_url:
        driver = VLLMDriver(VLLMHTTPConfig(base_url=base_url, connect_timeout_s=0.3),
                            capabilities=CAPS)
        await driver.start()
        try:
            with pytest.raises(EngineError) as err:
                await collect(driver, req({"model": "smollm2", "prompt": "x"}))
        finally:
            await driver.close()
    assert (err.value.status, err.value.message) == (504, "engine timed out: connect timed out")
    assert isinstance(err.value, EngineNotReached)


@pytest.mark.slow
async def test_engine_dying_mid_stream_is_a_502_after_the_chunks_so_far() -> None:
    state = Imitation(die_after_events=2)
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]}
    got = []
    async with running(state) as driver:
        with pytest.raises(EngineError) as err:
            async for chunk in driver.generate(req(body, route="chat", stream=True)):
                got.append(chunk)
    assert err.value.status == 502 and err.value.type == "UpstreamUnavailableError"
    assert not isinstance(err.value, EngineNotReached)  # the engine had the request
    assert len(got) == 2 and not any(c.done for c in got)


@pytest.mark.parametrize("cut", ["die_after_events", "cut_stream_after"])
async def test_a_stream_cut_short_makes_the_next_request_wait_for_a_re_probe(cut: str) -> None:
    """A connection reset or closed mid-stream may mean a new engine (SEC-16): the next
    request is sent only after a re-probe passed."""
    state = Imitation()
    chat = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]}
    async with running(state, caps=None, reprobe_interval_s=0.0) as driver:
        assert driver.probes == 1
        setattr(state, cut, 2)
        with pytest.raises(EngineError) as err:
            await collect(driver, req(chat, route="chat", stream=True))
        assert err.value.status == 502
        setattr(state, cut, None)
        assert await collect(driver, req({"model": "smollm2", "prompt": "x"}))
        assert driver.probes == 2


async def test_a_timeout_is_not_a_lost_connection() -> None:
    state = Imitation()
    async with running(state, caps=None, first_byte_timeout_s=0.3) as driver:
        state.head_delay_s = 0.6
        with pytest.raises(EngineError) as err:
            await collect(driver, req({"model": "smollm2", "prompt": "x"}))
        assert err.value.status == 504 and not isinstance(err.value, EngineNotReached)
        state.head_delay_s = 0.0
        assert await collect(driver, req({"model": "smollm2", "prompt": "x"}))
        assert driver.probes == 1


@contextlib.asynccontextmanager
async def canned(status: int, text: str, headers: dict[str, str]):
    """A real server answering every generation with these bytes; every path asked is
    logged (a followed redirect would show up there)."""
    seen: list[str] = []

    async def generation(request: web.Request) -> web.Response:
        seen.append(request.path)
        await request.read()
        return web.Response(status=status, text=text, headers=headers)

    async def anything_else(request: web.Request) -> web.Response:
        seen.append(request.path)
        return web.Response(status=200)

    app = web.Application()
    app.router.add_post("/v1/completions", generation)
    app.router.add_route("*", "/{tail:.*}", anything_else)
    runner, url = await serve_app(app)
    try:
        yield url, seen
    finally:
        await runner.cleanup()


JSON, TEXT, SSE = ({"Content-Type": t} for t in ("application/json", "text/plain",
                                                 "text/event-stream"))


@pytest.mark.parametrize(
    ("status", "text", "headers", "stream"),
    [
        (200, "not json", TEXT, False),
        (200, "[1, 2]", JSON, False),
        (200, '{"usage": {"prompt_tokens": "many"}}', JSON, False),
        (200, "data: {}\n\n", JSON, True),
        (200, "data: {}\n\n", SSE, True),
        (200, "data: nope\n\n", SSE, True),
        (307, "", {"Location": "/admin"}, False),
        (500, "<html>boom</html>", {"Content-Type": "text/html"}, False),
    ],
    ids=[
        "not-json",
        "not-object",
        "bad-usage",
        "sse-wrong-type",
        "no-done",
        "bad-event",
        "redirect",
        "html-500",
    ],
)
async def test_malformed_upstream(status: int, text: str, headers: dict[str, str],
                                  stream: bool) -> None:
    async with canned(status, text, headers) as (base_url, seen):
        driver = VLLMDriver(VLLMHTTPConfig(base_url=base_url), capabilities=CAPS)
        await driver.start()
        try:
            with pytest.raises(EngineError) as err:
                await collect(driver, req({"model": "smollm2", "prompt": "x"}, stream=stream))
        finally:
            await driver.close()
    assert seen == ["/v1/completions"]
    assert err.value.status == (500 if status == 500 else 502)
    assert "boom" in err.value.message or status != 500


def test_config_is_validated() -> None:
    with pytest.raises(ValueError):
        VLLMHTTPConfig(base_url="http://h", first_byte_timeout_s=10, total_timeout_s=5)
    with pytest.raises(ValueError):
        VLLMHTTPConfig(base_url="http://h", connect_timeout_s=0)
    with pytest.raises(ValueError):
        VLLMHTTPConfig(base_url="ftp://h")


async def test_serving_metrics_are_windowed_between_calls(state) -> None:
    async with running(state) as driver:
        first = await driver.serving_metrics()
        second = await driver.serving_metrics()
    assert first["prefix_cache_hit_ratio"] == pytest.approx(1280 / 9402)
    assert second["prefix_cache_queries"] == 0 and second["prefix_cache_hit_ratio"] is None
    assert second["running"] == 0
