"""Upstream failures as a tenant sees them through a real governor over the vLLM driver:
a refused connection is a 502, a timeout a 504 (both as the status while nothing was sent,
as one SSE error event and `[DONE]` once the stream is open), an engine dying mid-stream is
the chunks so far then a 502 event, a client that goes away aborts the upstream request, and
a whole answer leaves before it is accounted.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from adapters.vllm.http_driver import VLLMDriver, VLLMHTTPConfig
from governor.auth import sha256_hex
from governor.config import parse_config
from governor.http.relay import Relay
from governor.serve import build_governor
from governor.state import Governor
from schemas.engine import EngineCapabilities
from tests.adapters.vllm_imitation import Imitation, start_imitation
from tests.http_client import HTTP

from .server_thread import ServerThread

KEY = "key-acme"
CAPS = EngineCapabilities(engine_kind="vllm", model_id="smollm2", cache_salt=True)
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@contextlib.contextmanager
def governed(tmp_path: Path, state: Imitation | None, server: dict[str, Any] | None = None,
             **http: Any) -> Iterator[tuple[str, Governor]]:
    """A governor on loopback over the vLLM driver, in front of the imitation (None: a port
    nothing listens on)."""
    thread = ServerThread()
    runner = None
    try:
        if state is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                base_url = f"http://127.0.0.1:{s.getsockname()[1]}"
        else:
            runner, base_url = thread.run(start_imitation(state))
        driver = VLLMDriver(VLLMHTTPConfig(base_url, **http), capabilities=CAPS)
        thread.run(driver.start())
        config = parse_config({
            "server": {"data_dir": str(tmp_path), **(server or {})},
            "engine": {"kind": "vllm", "base_url": base_url},
            "tenants": [{"id": "acme", "api_key_sha256": [sha256_hex(KEY)]}]})
        gov = build_governor(config, driver, create_key=True)
        try:
            yield thread.serve(gov), gov
        finally:
            thread.run(driver.close())
            gov.audit.close()
    finally:
        if runner is not None:
            thread.run(runner.cleanup())
        thread.stop()


def post(url: str, body: dict[str, Any]) -> httpx.Response:
    return HTTP.post(url + "/v1/chat/completions", json=body, timeout=30,
                     headers={"Authorization": f"Bearer {KEY}"})


def events(response: httpx.Response) -> list[Any]:
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:])
            for line in response.text.split("\n") if line.startswith("data: ")]


def eventually(condition: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def settled(gov: Governor) -> bool:
    """Every admission slot given back (the handler's last step, after the answer's end)."""
    return eventually(lambda: gov.admission.in_flight == 0)


def assert_error(response: httpx.Response, status: int, kind: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"]) == (kind, status)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_refused_connection_is_a_502(tmp_path: Path, stream: bool) -> None:
    with governed(tmp_path, None) as (url, gov):
        assert_error(post(url, {**CHAT, "stream": stream}), 502, "UpstreamUnavailableError")
        assert settled(gov)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_upstream_timeout_is_a_504(tmp_path: Path, stream: bool) -> None:
    with governed(tmp_path, Imitation(head_delay_s=1.0), first_byte_timeout_s=0.2,
                  total_timeout_s=5.0) as (url, _):
        assert_error(post(url, {**CHAT, "stream": stream}), 504, "UpstreamTimeoutError")


def test_timeout_after_keepalives_is_one_sse_error(tmp_path: Path) -> None:
    """The stream already opened with keep-alive comments: the 504 is the last event."""
    with governed(tmp_path, Imitation(head_delay_s=1.0), {"keepalive_s": 0.05},
                  first_byte_timeout_s=0.4, total_timeout_s=5.0) as (url, _):
        response = post(url, {**CHAT, "stream": True})
    assert response.status_code == 200 and ": keep-alive" in response.text
    *_, error, done = events(response)
    assert (error["error"]["code"], done) == (504, "[DONE]")


@pytest.mark.slow
def test_engine_dying_mid_stream_ends_in_one_sse_error(tmp_path: Path) -> None:
    with governed(tmp_path, Imitation(die_after_events=2)) as (url, gov):
        response = post(url, {**CHAT, "stream": True})
        assert settled(gov)
    assert response.status_code == 200
    got = events(response)
    assert [e["object"] for e in got[:2]] == ["chat.completion.chunk"] * 2
    assert got[2]["error"]["type"] == "UpstreamUnavailableError"
    assert got[2]["error"]["code"] == 502 and got[3:] == ["[DONE]"]


@pytest.mark.slow
def test_client_disconnect_aborts_the_upstream_request(tmp_path: Path) -> None:
    state = Imitation(stream_delay_s=0.2)
    with governed(tmp_path, state) as (url, gov):
        with HTTP.stream("POST", url + "/v1/chat/completions", json={**CHAT, "stream": True},
                         headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as r:
            first = next(line for line in r.iter_lines() if line.startswith("data: "))
        assert json.loads(first[6:])["object"] == "chat.completion.chunk"
        assert eventually(state.disconnected.is_set), "the upstream request was not aborted"
        assert settled(gov)


def test_a_whole_answer_is_out_before_it_is_accounted(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The metrics wait until the client has its answer: accounting that holds the loop
    (here 2 s asleep) does not hold the answer, and is still done."""
    def complete() -> httpx.Response:
        return HTTP.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4},
                         timeout=30, headers={"Authorization": f"Bearer {KEY}"})

    with governed(tmp_path, Imitation()) as (url, gov):
        first = complete()  # the connections made, the engine probed
        assert first.status_code == 200 and settled(gov), first.text
        finish = Relay.finish

        def slow_finish(relay: Relay, outcome: str) -> None:
            time.sleep(2.0)
            finish(relay, outcome)

        monkeypatch.setattr(Relay, "finish", slow_finish)
        started = time.monotonic()
        response = complete()
        took = time.monotonic() - started
        assert response.status_code == 200 and response.json()["choices"]
        assert took < 1.5, f"the answer waited {took:.2f} s for the accounting"
        assert settled(gov)
        ok = [s.value for s in next(gov.metrics.served.collect()).samples
              if s.name.endswith("_total") and s.labels["outcome"] == "ok"]
        assert sum(ok) == 2
