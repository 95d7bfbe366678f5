"""The governor on loopback over the real native engine, driven by the official openai client."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from adapters.native import NativeDriver, NativeDriverConfig
from native_engine.config import EngineConfig
from tests.http_client import HTTP

from .governor_suite import (  # noqa: F401 - the shared suite runs here
    KEYS,
    Stack,
    every_salt,
    start_stack,
    stop_stack,
    test_admin_routes,
    test_bad_requests_get_openai_errors,
    test_chat_and_completions_for_two_tenants,
    test_concurrent_streams_four_tenants_accounting,
    test_sec2_client_salt_rejected_or_stripped,
    test_sec4_same_prompt_never_shared_across_tenants,
)

pytestmark = pytest.mark.slow
BLOCK = 16


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    driver = NativeDriver(NativeDriverConfig(engine=EngineConfig(
        num_blocks=512, block_size=BLOCK, max_model_len=1024, scheduling_policy="priority")))
    stack = start_stack(driver, tmp_path_factory.mktemp("gov"), {"kind": "native"}, BLOCK)
    yield stack
    stop_stack(stack)


def test_sec3_every_cached_block_is_in_a_governor_namespace(stack: Stack) -> None:
    """No unsalted path: after the suite's traffic, every namespace in the engine's radix
    cache is one of the tenants' governor salts."""
    gov = stack.gov
    HTTP.post(stack.urls["strict"] + "/v1/completions", json={"prompt": "x " * 40,
              "max_tokens": 1}, headers={"Authorization": f"Bearer {KEYS['delta']}"})
    namespaces = set(stack.thread.run(gov.driver.engine.call(lambda e: e.cache.namespaces)))
    assert namespaces and namespaces <= every_salt(gov)
    assert None not in namespaces


def test_client_disconnect_aborts_the_engine_request(stack: Stack) -> None:
    thread, gov, urls = stack.thread, stack.gov, stack.urls
    with HTTP.stream("POST", urls["strict"] + "/v1/completions",
                     json={"prompt": "Tell me a long story.", "max_tokens": 200,
                            "stream": True, "ignore_eos": True},
                     headers={"Authorization": f"Bearer {KEYS['acme']}"}) as r:
        next(r.iter_lines())
    deadline = time.monotonic() + 30
    engine = gov.driver.engine
    while time.monotonic() < deadline:
        if not thread.run(engine.call(lambda e: e.has_unfinished())):
            break
        time.sleep(0.1)
    assert not thread.run(engine.call(lambda e: e.has_unfinished()))
    assert gov.admission.in_flight == 0
