"""The governor on loopback over the real native engine, driven by the official openai client."""

from __future__ import annotations

import random
import string
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import openai
import pytest

from adapters.native import NativeDriver, NativeDriverConfig
from governor.auth import sha256_hex
from governor.config import parse_config
from governor.serve import build_governor
from governor.state import Governor
from native_engine.config import EngineConfig

from .server_thread import ServerThread

pytestmark = pytest.mark.slow

KEYS = {"acme": "key-acme", "beta": "key-beta", "gamma": "key-gamma", "delta": "key-delta"}
ADMIN = "admin-token"
BLOCK = 16


def _config(data_dir: Path, client_cache_salt: str = "reject", **server: object):
    tenants = [{"id": t, "api_key_sha256": [sha256_hex(k)], "class": c,
                "max_concurrency": 32, "max_tokens": 256}
               for (t, k), c in zip(KEYS.items(), ("interactive", "standard", "batch",
                                                    "background"), strict=True)]
    return parse_config({"server": {"data_dir": str(data_dir), "admin_token_sha256":
                                    sha256_hex(ADMIN), "client_cache_salt": client_cache_salt,
                                    **server},
                         "engine": {"kind": "native"}, "tenants": tenants})


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerThread, Governor,
                                                                        dict[str, str]]]:
    data_dir = tmp_path_factory.mktemp("gov")
    thread = ServerThread()
    driver = NativeDriver(NativeDriverConfig(engine=EngineConfig(
        num_blocks=512, block_size=BLOCK, max_model_len=1024, scheduling_policy="priority")))
    thread.run(driver.start())
    strict = build_governor(_config(data_dir), driver, create_key=True)
    lenient = Governor(replace(strict.config, server=replace(strict.config.server,
                                                             client_cache_salt="strip")),
                       driver, strict.salt_key, strict.epochs, strict.audit)
    urls = {"strict": thread.serve(strict), "lenient": thread.serve(lenient)}
    yield thread, strict, urls
    thread.run(driver.close())
    thread.stop()


def client(url: str, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEYS[tenant], max_retries=0)


def random_prompt(tokens_hint: int) -> str:
    rng = random.Random(time.time_ns())
    return " ".join(rng.choice(string.ascii_lowercase) for _ in range(tokens_hint))


def test_chat_and_completions_for_two_tenants(stack) -> None:
    _, _, urls = stack
    for tenant in ("acme", "beta"):
        c = client(urls["strict"], tenant)
        chat = c.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "What is the capital of "
                                        "France?"}], max_tokens=12, temperature=0)
        assert "Paris" in chat.choices[0].message.content
        assert chat.usage.prompt_tokens_details.cached_tokens is not None
        comp = c.completions.create(model="smollm2", prompt="One, two, three,", max_tokens=6,
                                    temperature=0)
        assert comp.choices[0].text and comp.usage.completion_tokens == 6
        parts = list(c.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=8, temperature=0, stream=True))
        assert parts and "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
        assert all(p.usage is None for p in parts), "usage chunk leaked without include_usage"
        parts = list(c.completions.create(model="smollm2", prompt="Once upon a time",
                                          max_tokens=6, temperature=0, stream=True,
                                          stream_options={"include_usage": True}))
        assert parts[-1].usage.completion_tokens == 6 and parts[-1].choices == []
        assert "".join(p.choices[0].text for p in parts[:-1])


def test_sec4_same_prompt_never_shared_across_tenants(stack) -> None:
    _, _, urls = stack
    prompt = random_prompt(6 * BLOCK)
    a, b = client(urls["strict"], "acme"), client(urls["strict"], "beta")

    def cached(c: openai.OpenAI) -> int:
        r = c.completions.create(model="smollm2", prompt=prompt, max_tokens=1, temperature=0)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached(a) == 0
    assert cached(a) >= 3 * BLOCK
    assert cached(b) == 0
    assert cached(b) >= 3 * BLOCK


def test_sec2_client_salt_rejected_or_stripped(stack) -> None:
    _, gov, urls = stack
    body = {"model": "smollm2", "prompt": "hi", "max_tokens": 2,
            "cache_salt": gov.salt_for("acme")}
    r = httpx.post(urls["strict"] + "/v1/completions", json=body,
                   headers={"Authorization": f"Bearer {KEYS['beta']}"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "cache_salt"
    log = gov.config.server.data_dir / "audit.log"
    assert '"kind":"client_salt_rejected"' in log.read_text()
    nested = {**body, "extra_body": {"cache_salt": "x"}}
    nested.pop("cache_salt")
    r = httpx.post(urls["strict"] + "/v1/completions", json=nested,
                   headers={"Authorization": f"Bearer {KEYS['beta']}"})
    assert r.status_code == 400
    # Lenient: stripped, and B's own salt is used — B's warm prompt hits only B's cache.
    prompt = random_prompt(4 * BLOCK)
    a = client(urls["strict"], "acme")
    for _ in range(2):
        a.completions.create(model="smollm2", prompt=prompt, max_tokens=1)
    r = httpx.post(urls["lenient"] + "/v1/completions",
                   json={**body, "prompt": prompt, "max_tokens": 1},
                   headers={"Authorization": f"Bearer {KEYS['beta']}"})
    assert r.status_code == 200
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    metrics = httpx.get(urls["lenient"] + "/metrics").text
    assert 'fak_client_cache_salt_total{action="stripped",tenant="beta"}' in metrics


def test_bad_requests_get_openai_errors(stack) -> None:
    _, _, urls = stack
    url = urls["strict"] + "/v1/chat/completions"
    auth = {"Authorization": f"Bearer {KEYS['acme']}"}
    cases = [
        ({}, {"messages": [{"role": "user", "content": "x"}]}, 401, None),
        (auth, {"messages": []}, 400, "messages"),
        (auth, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}, 400,
         "max_tokens"),
        (auth, {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400,
         "temperature"),
        (auth, {"messages": [{"role": "user", "content": "x"}], "model": "nope"}, 404,
         "model"),
    ]
    for headers, body, status, param in cases:
        r = httpx.post(url, json=body, headers=headers)
        assert r.status_code == status, (body, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["param"] == param
    r = httpx.post(url, content=b"{not json", headers={**auth,
                                                       "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"]
    r = httpx.post(url, content=b"x" * (2 << 20), headers=auth)
    assert r.status_code == 413
    assert httpx.get(urls["strict"] + "/health").status_code == 200


def test_64_concurrent_streams_four_tenants_accounting(stack) -> None:
    _, _, urls = stack
    before = httpx.get(urls["strict"] + "/metrics").text
    totals: dict[str, int] = dict.fromkeys(KEYS, 0)
    errors: list[BaseException] = []
    lock = threading.Lock()

    def one(tenant: str, i: int) -> None:
        try:
            parts = list(client(urls["strict"], tenant).completions.create(
                model="smollm2", prompt=f"Count with me: {i},", max_tokens=4 + i % 3,
                temperature=0, stream=True, stream_options={"include_usage": True}))
            with lock:
                totals[tenant] += parts[-1].usage.completion_tokens
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(t, i))
               for i in range(16) for t in KEYS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors[:3]
    after = httpx.get(urls["strict"] + "/metrics").text
    for tenant, expected in totals.items():
        assert expected == sum(4 + i % 3 for i in range(16))
        delta = _counter(after, tenant) - _counter(before, tenant)
        assert delta == expected, tenant


def _counter(text: str, tenant: str) -> float:
    prefix = f'fak_completion_tokens_total{{tenant="{tenant}"}} '
    return next((float(line[len(prefix):]) for line in text.splitlines()
                 if line.startswith(prefix)), 0.0)


def test_client_disconnect_aborts_the_engine_request(stack) -> None:
    thread, gov, urls = stack
    with httpx.stream("POST", urls["strict"] + "/v1/completions",
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


def test_admin_routes(stack) -> None:
    _, gov, urls = stack
    admin = {"Authorization": f"Bearer {ADMIN}"}
    assert httpx.get(urls["strict"] + "/admin/v1/capabilities").status_code == 401
    assert httpx.get(urls["strict"] + "/admin/v1/capabilities",
                     headers={"Authorization": f"Bearer {KEYS['acme']}"}).status_code == 401
    caps = httpx.get(urls["strict"] + "/admin/v1/capabilities", headers=admin).json()
    assert caps["exact_span_evict"] is True and caps["cache_salt"] is True
    tenants = httpx.get(urls["strict"] + "/admin/v1/tenants", headers=admin).json()["data"]
    assert {t["id"] for t in tenants} == set(KEYS)
    assert httpx.get(urls["strict"] + "/ready").json() == {"ready": True}
    epoch = gov.epochs.get("gamma")
    old_salt = gov.salt_for("gamma")
    r = httpx.post(urls["strict"] + "/admin/v1/tenants/gamma/rotate", headers=admin)
    assert r.status_code == 200
    record = r.json()
    assert record["event"]["kind"] == "rotate"
    assert record["event"]["evidence"]["new_epoch"] == epoch + 1
    assert gov.epochs.get("gamma") == epoch + 1 and gov.salt_for("gamma") != old_salt
    assert httpx.post(urls["strict"] + "/admin/v1/tenants/nobody/rotate",
                      headers=admin).status_code == 404
    log = (gov.config.server.data_dir / "audit.log").read_text()
    assert '"kind":"rotate"' in log and old_salt not in log
