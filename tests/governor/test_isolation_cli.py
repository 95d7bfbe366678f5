"""`fak audit isolation` as a command: its contract flags, bad usage and an unreachable
endpoint answered in one line with exit 2; its TTFT client on the recorded bytes of a real
vLLM 0.32 chat stream (the audit itself runs in test_isolation.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web

from governor.cli import build_parser, main
from governor.isolation.client import TtftClient
from tests.adapters.vllm_imitation import SSE_LINES

from .server_thread import ServerThread, free_port

FIRST_TOKEN_DELAY_S = 0.3

BASE = ["audit", "isolation", "--key-a", "a", "--key-b", "b"]


def test_contract_flags() -> None:
    args = build_parser().parse_args([*BASE, "--base-url", "http://h:1", "--samples", "7",
                                      "--prompt-tokens", "300", "--out", "r.json"])
    assert (args.base_url, args.key_a, args.key_b, args.samples, args.prompt_tokens,
            args.out) == ("http://h:1", "a", "b", 7, 300, "r.json")
    defaults = build_parser().parse_args([*BASE, "--base-url", "http://h:1"])
    assert (defaults.samples, defaults.prompt_tokens, defaults.alpha,
            defaults.control_alpha) == (100, 512, 0.01, 1e-6)


@pytest.mark.parametrize("bad", [["--base-url", "h:1"], ["--base-url", "http://h:1",
                                                         "--samples", "1"],
                                 ["--base-url", "http://h:1", "--prefix-fraction", "1"],
                                 ["--base-url", "http://h:1", "--alpha", "0"]])
def test_bad_usage_exits_2(bad: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*BASE, *bad]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fak audit isolation: ") and len(err.strip().splitlines()) == 1


def test_unreachable_endpoint_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert main([*BASE, "--base-url", url, "--samples", "2", "--timeout", "5"]) == 2
    err = capsys.readouterr().err
    assert "key A" in err and "/v1/models" in err and "Traceback" not in err


@pytest.fixture
def recorded_stream() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """A loopback server answering the first chat request with 429 (Retry-After: 0) and the
    next ones with the recorded stream: a keep-alive comment and the role-only delta at once,
    the first content token FIRST_TOKEN_DELAY_S later."""
    bodies: list[dict[str, Any]] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        bodies.append(await request.json())
        if len(bodies) == 1:
            return web.json_response({"error": {"message": "slow down"}}, status=429,
                                     headers={"Retry-After": "0"})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b": keep-alive\n\n" + SSE_LINES[0].encode() + b"\n\n")
        await asyncio.sleep(FIRST_TOKEN_DELAY_S)
        for line in SSE_LINES[1:]:
            await response.write(line.encode() + b"\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    thread = ServerThread()
    port = free_port()
    thread.run(runner.setup())
    thread.run(web.TCPSite(runner, "127.0.0.1", port).start())
    yield f"http://127.0.0.1:{port}", bodies
    thread.run(runner.cleanup())
    thread.stop()


def test_ttft_is_the_first_token_not_the_role_delta(
        recorded_stream: tuple[str, list[dict[str, Any]]]) -> None:
    url, bodies = recorded_stream
    client = TtftClient(url, "key", "A", 10.0, "smollm2", "chat")
    try:
        timed = client.measure("a b c")
    finally:
        client.close()
    assert FIRST_TOKEN_DELAY_S <= timed.ttft_s < FIRST_TOKEN_DELAY_S + 1.0
    assert (timed.prompt_tokens, timed.cached_tokens) == (31, 0)
    assert len(bodies) == 2 and bodies[0] == bodies[1]  # the 429 was retried
    assert json.dumps(bodies[1], sort_keys=True) == json.dumps({
        "max_tokens": 1, "messages": [{"content": "a b c", "role": "user"}],
        "model": "smollm2", "stream": True, "stream_options": {"include_usage": True},
        "temperature": 0}, sort_keys=True)
