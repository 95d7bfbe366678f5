"""Arbitrary JSON against a live governor (issue 11): the generation routes and the admin
routes never answer 500, never hang, never leak an exception's text, and every error is
OpenAI-shaped. The engine is the real native engine on a tiny random model (the mechanics
are under test, not the model); bodies mix the fields the routes know with noise."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapters.native import NativeDriver, NativeDriverConfig
from governor.auth import sha256_hex
from governor.config import parse_config
from governor.serve import build_governor
from native_engine.config import EngineConfig
from native_engine.engine import LLMEngine
from policies.request_fields import FEATURE_GROUPS, ROUTE_FIELDS
from tests.http_client import HTTP
from tests.native_engine.tiny_model import random_model

from .server_thread import ServerThread

ADMIN = "admin-fuzz"
KEY = "key-fuzz"
FIELDS = sorted(set(ROUTE_FIELDS["chat"]) | set(ROUTE_FIELDS["completions"])
                | {n for names in FEATURE_GROUPS.values() for n in names}
                | {"cache_salt", "priority", "extra_body", "tenant", "span", "start",
                   "reason", "require_exact"})

scalars = (st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=5)
                           | st.dictionaries(st.text(max_size=12) | st.sampled_from(FIELDS),
                                             inner, max_size=5), max_leaves=30)
bodies = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=12), json_values,
                         max_size=8) | json_values
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "nobody", 3]),
     "content": st.none() | st.text(max_size=20) | st.lists(json_values, max_size=3)}),
    max_size=3)


@dataclass
class Live:
    url: str
    thread: ServerThread


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    data_dir: Path = tmp_path_factory.mktemp("fuzz")
    config = EngineConfig(num_blocks=64, block_size=8, max_model_len=256,
                          scheduling_policy="priority", max_num_batched_tokens=256)
    engine = LLMEngine.from_config(config, loaded=random_model(seed=5))
    driver = NativeDriver(NativeDriverConfig(engine=config), engine=engine)
    thread = ServerThread()
    thread.run(driver.start())
    gov = build_governor(parse_config({
        "server": {"data_dir": str(data_dir), "admin_token_sha256": sha256_hex(ADMIN),
                   "client_cache_salt": "strip"},
        "engine": {"kind": "native"},
        "tenants": [{"id": "fuzz", "api_key_sha256": [sha256_hex(KEY)], "max_tokens": 4,
                     "max_concurrency": 4}]}), driver, create_key=True)
    url = thread.serve(gov)
    yield Live(url, thread)
    thread.run(driver.close())
    thread.stop()
    gov.audit.close()


def check(r: httpx.Response) -> None:
    assert r.status_code < 500, r.text[:300]
    assert "Traceback" not in r.text and "File \"" not in r.text
    if r.status_code >= 400:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}


def post(live: Live, path: str, body: Any, key: str) -> httpx.Response:
    return HTTP.post(live.url + path, content=json.dumps(body).encode(), timeout=60,
                     headers={"Authorization": f"Bearer {key}",
                               "Content-Type": "application/json"})


FUZZ = settings(max_examples=120, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


@FUZZ
@given(body=bodies)
def test_completions_take_any_json(live: Live, body: Any) -> None:
    check(post(live, "/v1/completions", body, KEY))


@FUZZ
@given(body=bodies, msgs=messages)
def test_chat_takes_any_json(live: Live, body: Any, msgs: list[Any]) -> None:
    if isinstance(body, dict):
        body = {**body, "messages": msgs}
    check(post(live, "/v1/chat/completions", body, KEY))


@FUZZ
@given(body=bodies)
def test_admin_quarantine_takes_any_json(live: Live, body: Any) -> None:
    check(post(live, "/admin/v1/quarantine", body, ADMIN))


@FUZZ
@given(tenant=st.text(min_size=1, max_size=20))
def test_admin_rotate_takes_any_tenant(live: Live, tenant: str) -> None:
    r = HTTP.post(f"{live.url}/admin/v1/tenants/{quote(tenant, safe='')}/rotate",
                  timeout=30, headers={"Authorization": f"Bearer {ADMIN}"})
    check(r)
    assert r.status_code in (200, 404)


def test_raw_garbage_bytes(live: Live) -> None:
    for raw in (b"\xff\xfe", b"{", b"[" * 5000, b'{"a": NaN}', b"\x00" * 100, b'"\\ud800"'):
        for path in ("/v1/completions", "/v1/chat/completions", "/admin/v1/quarantine"):
            key = ADMIN if "admin" in path else KEY
            r = HTTP.post(live.url + path, content=raw, timeout=30,
                          headers={"Authorization": f"Bearer {key}"})
            check(r)
            assert r.status_code == 400
