"""The governor suite riding a vLLM-compatible server over its public surfaces: the real
vLLM 0.32 CPU server, and `fak engine serve` — the same driver, the same tests."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from governor.config import EngineSection
from governor.serve import build_vllm_driver
from schemas.tenants import CapabilityDeclaration
from tests.governor.governor_suite import (  # noqa: F401 - the shared suite runs here
    KEYS,
    Stack,
    every_salt,
    random_prompt,
    start_stack,
    stop_stack,
    test_admin_routes,
    test_bad_requests_get_openai_errors,
    test_chat_and_completions_for_two_tenants,
    test_concurrent_streams_four_tenants_accounting,
    test_sec2_client_salt_rejected_or_stripped,
    test_sec4_same_prompt_never_shared_across_tenants,
)
from tests.http_client import HTTP

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def engine_section(server) -> dict:
    """The [engine] section an operator writes: endpoints as in the engine's own config."""
    port = server.kv_endpoint.rsplit(":", 1)[1]
    kv = f"tcp://*:{port}" if server.kv_endpoint_mode == "connect" else server.kv_endpoint
    return {"kind": "vllm", "base_url": server.base_url, "model": server.model,
            "kv_events": kv, "kv_replay": server.replay_endpoint,
            "declare": {"prompt_tokens_details": True, "priority_scheduling": True,
                        "prefix_reset": True}}


@pytest.fixture(scope="module", params=["vllm", "native"])
def stack(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    server = request.getfixturevalue("vllm_server" if request.param == "vllm"
                                     else "native_vllm_server")
    engine = engine_section(server)
    section = EngineSection(**{**engine, "declare": CapabilityDeclaration(**engine["declare"])})
    stack = start_stack(build_vllm_driver(section), tmp_path_factory.mktemp("gov"), engine,
                        server.block_size)
    yield stack
    stop_stack(stack)


def test_capabilities_probed_from_the_surfaces(stack: Stack) -> None:
    caps = stack.gov.driver.capabilities
    assert caps.engine_kind == "vllm" and caps.model_id == "smollm2"
    assert caps.cache_salt and caps.cached_tokens_in_usage and caps.kv_events and caps.kv_replay
    assert caps.prefix_reset and not caps.exact_span_evict
    assert caps.block_size == stack.block
    # SEC-16: isolation facts probed, not assumed
    assert caps.prefix_caching_hash_algo == "sha256_cbor" and caps.engine_version
    assert {"cache_salt", "cached_tokens_in_usage", "prefix_caching_hash_algo"} <= set(
        caps.probed)
    assert any("a fresh salt 0" in note for note in caps.notes)


def test_sec3_no_unsalted_block_reaches_the_engine(stack: Stack) -> None:
    """Every block the engine stores for governed traffic sits in a governor namespace:
    nothing lands in the unsalted namespace, and each tenant's blocks carry its salt."""
    kv = stack.gov.driver.kv
    index = kv.index()
    unsalted_before = index.resident(None)
    prompts = {t: random_prompt(3 * stack.block) for t in KEYS}
    for route, body in (("completions", {"prompt": None}),
                        ("chat/completions", {"messages": None})):
        for tenant, prompt in prompts.items():
            payload = dict(body, max_tokens=1)
            if "prompt" in payload:
                payload["prompt"] = prompt
            else:
                payload["messages"] = [{"role": "user", "content": prompt}]
            r = HTTP.post(f"{stack.urls['strict']}/v1/{route}", json=payload, timeout=300,
                          headers={"Authorization": f"Bearer {KEYS[tenant]}"})
            assert r.status_code == 200, r.text
    deadline = time.monotonic() + 30
    salts = {t: stack.gov.salt_for(t) for t in KEYS}
    while time.monotonic() < deadline and not all(index.resident(s) for s in salts.values()):
        time.sleep(0.2)
    assert all(index.resident(s) for s in salts.values())
    assert index.resident(None) <= unsalted_before
    digests = {index.namespace_id(s): s for s in every_salt(stack.gov)}
    governed = {digests[ns] for ns in index.namespaces() if ns in digests}
    assert set(salts.values()) <= governed
