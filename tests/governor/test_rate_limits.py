"""Per-tenant rate limits end to end, on a real governor (aiohttp on loopback) over the real
native engine (the tiny random-weight Llama: these are mechanics): a tenant over its
`requests_per_s` or `tokens_per_min` gets 429 with a Retry-After that is exactly when it may
come back — not later (it is let in then) and not a second earlier (still refused) — while
the other tenants are served as before."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from adapters.native import NativeDriver, NativeDriverConfig
from governor.auth import sha256_hex
from governor.config import parse_config
from governor.errors import rate_limited
from governor.serve import build_governor
from governor.state import Governor
from native_engine.config import EngineConfig
from native_engine.engine import LLMEngine
from tests.http_client import HTTP
from tests.native_engine.tiny_model import random_model

from .server_thread import ServerThread

REQUESTS_PER_S = 0.5  # capacity 1: one request, then one every 2 s
TOKENS_PER_MIN = 120  # 2 tokens/s, capacity 120
TENANTS: dict[str, dict[str, Any]] = {
    "slow": {"requests_per_s": REQUESTS_PER_S},
    "metered": {"tokens_per_min": TOKENS_PER_MIN},
    "streamed": {"tokens_per_min": TOKENS_PER_MIN},
    "free": {},
}
EARLY_MARGIN_S = 0.3  # how much earlier than Retry-After − 1 s the early retry is sent
BIG = {"prompt": "x" * 100, "max_tokens": 28, "ignore_eos": True, "temperature": 0}


@dataclass
class Limited:
    thread: ServerThread
    gov: Governor
    url: str

    def post(self, tenant: str, body: dict[str, Any]) -> httpx.Response:
        return HTTP.post(self.url + "/v1/completions", json=body, timeout=60,
                         headers={"Authorization": f"Bearer key-{tenant}"})

    def metrics(self) -> str:
        return HTTP.get(self.thread.metrics_urls[self.url] + "/metrics").text


@pytest.mark.parametrize(("wait", "header"), [(0.0, "1"), (0.2, "1"), (1.0, "1"),
                                              (1.0005, "2"), (3.9999, "4"), (59.0001, "60")])
def test_retry_after_is_the_wait_rounded_up(wait: float, header: str) -> None:
    """Whole seconds, never less than the wait (a client that waits exactly Retry-After
    must not be refused again), at least 1."""
    err = rate_limited("requests_per_s", wait)
    assert err.status == 429 and err.headers == {"Retry-After": header}


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Limited]:
    engine = EngineConfig(block_size=4, num_blocks=256, max_num_batched_tokens=256,
                          max_model_len=512, dtype="float32", attention_backend="torch",
                          scheduling_policy="priority")
    driver = NativeDriver(NativeDriverConfig(engine=engine, served_model_name="tiny"),
                          LLMEngine.from_config(engine, loaded=random_model(seed=3)))
    tenants = [{"id": t, "api_key_sha256": [sha256_hex(f"key-{t}")], "max_concurrency": 4,
                **limits} for t, limits in TENANTS.items()]
    config = parse_config({"server": {"data_dir": str(tmp_path_factory.mktemp("rl"))},
                           "engine": {"kind": "native"}, "tenants": tenants})
    thread = ServerThread()
    thread.run(driver.start())
    gov = build_governor(config, driver, create_key=True)
    yield Limited(thread, gov, thread.serve(gov))
    thread.run(driver.close())
    thread.stop()


def small(max_tokens: int = 2) -> dict[str, Any]:
    return {"prompt": "hello", "max_tokens": max_tokens, "temperature": 0}


def retry_after(r: httpx.Response, reason: str) -> int:
    """The 429's Retry-After, checked against its OpenAI-style body."""
    assert r.status_code == 429, r.text
    error = r.json()["error"]
    assert error["type"] == "rate_limit_error" and reason in error["message"]
    seconds = int(r.headers["Retry-After"])
    assert seconds >= 1 and f"retry in {seconds} s" in error["message"]
    return seconds


def free_is_served(limited: Limited) -> None:
    """A tenant without limits sends more than the limited tenant may, at full speed."""
    for _ in range(5):
        start = time.monotonic()
        r = limited.post("free", small())
        assert r.status_code == 200, r.text
        assert time.monotonic() - start < 10


def come_back(limited: Limited, tenant: str, sent_at: float, received_at: float,
              seconds: int, reason: str) -> None:
    """The wait the 429 names is over `seconds` − 1 after the refusal (which was no earlier
    than `sent_at`): a retry sent then (less a margin for the trip) is refused. It is over
    `seconds` after the refusal (no later than `received_at`): a retry then is let in."""
    early = sent_at + seconds - 1 - EARLY_MARGIN_S
    if early > time.monotonic():
        time.sleep(early - time.monotonic())
        retry_after(limited.post(tenant, small()), reason)
    time.sleep(max(0.0, received_at + seconds - time.monotonic()))
    r = limited.post(tenant, small())
    assert r.status_code == 200, r.text


@pytest.mark.slow
def test_requests_per_s_refuses_with_the_right_retry_after(limited: Limited) -> None:
    start = time.monotonic()
    assert limited.post("slow", small()).status_code == 200
    sent_at = time.monotonic()
    r = limited.post("slow", small())
    received_at = time.monotonic()
    seconds = retry_after(r, "requests_per_s")
    # One token was taken between `start` and `sent_at`; it is back 1 / rate after that.
    full_wait = 1 / REQUESTS_PER_S
    assert math.ceil(full_wait - (received_at - start)) <= seconds <= math.ceil(full_wait)
    free_is_served(limited)
    come_back(limited, "slow", sent_at, received_at, seconds, "requests_per_s")
    assert 'tenant="slow"' in limited.metrics()
    assert 'reason="requests_per_s"' in limited.metrics()


@pytest.mark.slow
def test_tokens_per_min_debt_is_refused_until_refilled(limited: Limited) -> None:
    """A request that uses more than the bucket holds is let in (its size is known only at
    its end) and leaves a debt; the next is refused until the debt has refilled."""
    start = time.monotonic()
    first = limited.post("metered", BIG)
    assert first.status_code == 200, first.text
    debt = first.json()["usage"]["total_tokens"] - TOKENS_PER_MIN
    assert debt > 4, first.json()["usage"]  # the request left the bucket in debt
    sent_at = time.monotonic()
    r = limited.post("metered", small())
    received_at = time.monotonic()
    seconds = retry_after(r, "tokens_per_min")
    # The bucket refills at TOKENS_PER_MIN / 60 per second, from `start` at the earliest.
    rate = TOKENS_PER_MIN / 60
    assert math.ceil(debt / rate - (received_at - start)) <= seconds <= math.ceil(debt / rate)
    free_is_served(limited)
    come_back(limited, "metered", sent_at, received_at, seconds, "tokens_per_min")
    assert 'reason="tokens_per_min"' in limited.metrics()


@pytest.mark.slow
def test_a_streamed_request_is_charged_too(limited: Limited) -> None:
    """A stream's tokens (from the usage chunk the governor asks for even when the client
    does not, and does not pass on) are debited like a whole response's."""
    with HTTP.stream("POST", limited.url + "/v1/completions", json={**BIG, "stream": True},
                     timeout=60, headers={"Authorization": "Bearer key-streamed"}) as r:
        assert r.status_code == 200
        lines = list(r.iter_lines())
    assert "data: [DONE]" in lines and not any('"usage"' in line for line in lines)
    retry_after(limited.post("streamed", small()), "tokens_per_min")
