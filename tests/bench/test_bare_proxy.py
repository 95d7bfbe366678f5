"""bench/line_rate.py's bare aiohttp proxy, the floor fak is measured against: a whole
answer's bytes as the upstream sent them, and a stream's events as they arrive (not once
the stream has ended)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.governor.server_thread import free_port
from tests.processes import serving

pytestmark = pytest.mark.slow
BENCH = Path(__file__).resolve().parents[2] / "bench"
INTERVAL_S = 0.25


def test_the_bare_proxy_relays_answers_whole_and_streams_as_they_come() -> None:
    up, proxy = free_port(), free_port()
    upstream = f"http://127.0.0.1:{up}"
    with serving([str(BENCH / "instant_upstream.py"), "--port", str(up), "--interval-ms",
                  str(int(INTERVAL_S * 1000))], upstream + "/health"), \
            serving([str(BENCH / "line_rate.py"), "proxy", "aiohttp", str(proxy), upstream],
                    f"http://127.0.0.1:{proxy}/health"):
        url = f"http://127.0.0.1:{proxy}/v1/completions"
        body = {"model": "m", "prompt": "hi", "max_tokens": 3}
        direct = httpx.post(upstream + "/v1/completions", json=body, timeout=10)
        relayed = httpx.post(url, json=body, timeout=10)
        assert relayed.status_code == 200 and relayed.headers["Content-Type"].startswith(
            "application/json")
        assert relayed.json()["choices"] == direct.json()["choices"]

        arrivals: list[tuple[float, bytes]] = []
        start = time.monotonic()
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=10) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if line.startswith("data: "):
                    arrivals.append((time.monotonic() - start, line.encode()))
    assert [line for _, line in arrivals][-1] == b"data: [DONE]"
    assert len(arrivals) == 4
    # The first event left the upstream ~3 intervals before its last: relayed at once.
    assert arrivals[0][0] < arrivals[-1][0] - 1.5 * INTERVAL_S, arrivals


def test_the_tcp_relay_pipes_both_ways_on_one_connection() -> None:
    up, relay = free_port(), free_port()
    upstream = f"http://127.0.0.1:{up}"
    with serving([str(BENCH / "instant_upstream.py"), "--port", str(up), "--interval-ms",
                  str(int(INTERVAL_S * 1000))], upstream + "/health"), \
            serving([str(BENCH / "line_rate.py"), "relay", str(relay), upstream],
                    f"http://127.0.0.1:{relay}/health"), \
            httpx.Client(base_url=f"http://127.0.0.1:{relay}", timeout=10) as client:
        body = {"model": "m", "prompt": "hi", "max_tokens": 3}
        direct = httpx.post(upstream + "/v1/completions", json=body, timeout=10)
        relayed = [client.post("/v1/completions", json=body) for _ in range(2)]
        for r in relayed:  # `created` is the upstream's clock: the rest must match
            assert r.headers["Content-Type"] == direct.headers["Content-Type"]
            assert {**r.json(), "created": 0} == {**direct.json(), "created": 0}
        assert relayed[1].extensions["network_stream"] is relayed[0].extensions[
            "network_stream"]  # one keep-alive connection, two requests through it

        arrivals: list[float] = []
        start = time.monotonic()
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    arrivals.append(time.monotonic() - start)
    assert len(arrivals) == 4
    assert arrivals[0] < arrivals[-1] - 1.5 * INTERVAL_S, arrivals
