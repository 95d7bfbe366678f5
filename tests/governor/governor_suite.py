"""The engine-agnostic governor suite: the same tests run over every engine driver.

Each engine's test module builds a `Stack` fixture named `stack` and imports these tests.
"""

from __future__ import annotations

import random
import string
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import openai

from adapters.driver import EngineDriver
from governor.auth import sha256_hex
from governor.config import parse_config
from governor.serve import build_governor
from governor.state import Governor
from policies.salts import tenant_salt
from schemas.engine import EngineRequest
from tests.http_client import HTTP

from .server_thread import ServerThread

KEYS = {"acme": "key-acme", "beta": "key-beta", "gamma": "key-gamma", "delta": "key-delta"}
ADMIN = "admin-token"


@dataclass
class Stack:
    thread: ServerThread
    gov: Governor
    urls: dict[str, str]
    block: int

    def metrics(self, which: str = "strict") -> str:
        """The governor's /metrics text, from its private listener."""
        return HTTP.get(self.thread.metrics_urls[self.urls[which]] + "/metrics").text

    def direct(self, route: str, body: dict[str, Any], tenant: str) -> list[Any]:
        """The same request straight to the engine driver, in the tenant's namespace."""
        salt = self.gov.salt_for(tenant)
        request = EngineRequest.of(f"direct-{time.time_ns()}", route,  # type: ignore[arg-type]
                                   {**body, "model": self.gov.driver.capabilities.model_id},
                                   tenant, salt)

        async def collect() -> list[Any]:
            return [c async for c in self.gov.driver.generate(request)]

        return self.thread.run(collect())


def governor_config(data_dir: Path, engine: dict[str, Any]):
    tenants = [{"id": t, "api_key_sha256": [sha256_hex(k)], "class": c,
                "max_concurrency": 32, "max_tokens": 256}
               for (t, k), c in zip(KEYS.items(), ("interactive", "standard", "batch",
                                                    "background"), strict=True)]
    return parse_config({"server": {"data_dir": str(data_dir), "admin_token_sha256":
                                    sha256_hex(ADMIN), "client_cache_salt": "reject"},
                         "engine": engine, "tenants": tenants})


def start_stack(driver: EngineDriver, data_dir: Path, engine: dict[str, Any],
                block: int) -> Stack:
    """A strict (reject) and a lenient (strip) governor over one started driver."""
    thread = ServerThread()
    thread.run(driver.start())
    strict = build_governor(governor_config(data_dir, engine), driver, create_key=True)
    lenient = Governor(replace(strict.config, server=replace(strict.config.server,
                                                             client_cache_salt="strip")),
                       driver, strict.salt_key, strict.epochs, strict.audit)
    return Stack(thread, strict, {"strict": thread.serve(strict),
                                  "lenient": thread.serve(lenient)}, block)


def stop_stack(stack: Stack) -> None:
    stack.thread.run(stack.gov.driver.close())
    stack.thread.stop()


def every_salt(gov: Governor) -> set[str]:
    """The governor's salts for every tenant at every epoch it has had."""
    return {tenant_salt(gov.salt_key, t, e) for t in KEYS for e in range(gov.epochs.get(t) + 1)}


def client(url: str, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEYS[tenant], max_retries=0)


def random_prompt(tokens_hint: int) -> str:
    rng = random.Random(time.time_ns())
    return " ".join(rng.choice(string.ascii_lowercase) for _ in range(tokens_hint))


def test_chat_and_completions_for_two_tenants(stack) -> None:
    """Governed answers equal the engine's direct answer for the same request and salt
    (both sent with the prompt already cached, so both take the same compute path)."""
    urls = stack.urls
    question = [{"role": "user", "content": "What is the capital of France?"}]
    for tenant in ("acme", "beta"):
        c = client(urls["strict"], tenant)
        first = c.chat.completions.create(model="smollm2", messages=question, max_tokens=12,
                                          temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens is not None
        direct = stack.direct("chat", {"messages": question, "max_tokens": 12,
                                       "temperature": 0}, tenant)
        chat = c.chat.completions.create(model="smollm2", messages=question, max_tokens=12,
                                         temperature=0)
        assert chat.choices[0].message.content == \
            direct[0].data["choices"][0]["message"]["content"]
        assert chat.choices[0].message.content
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
    """Both tenants start from empty namespaces (epoch bump), so "0 cached tokens" is exact
    even on a token-level radix cache, where a tenant's own earlier random prompts could
    share a first letter."""
    urls = stack.urls
    for tenant in ("acme", "beta"):
        stack.thread.run(stack.gov.rotate(tenant, actor="sec4-test"))
    prompt = random_prompt(6 * stack.block)
    a, b = client(urls["strict"], "acme"), client(urls["strict"], "beta")

    def cached(c: openai.OpenAI) -> int:
        r = c.completions.create(model="smollm2", prompt=prompt, max_tokens=1, temperature=0)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached(a) == 0
    assert cached(a) >= 2 * stack.block
    assert cached(b) == 0
    assert cached(b) >= 2 * stack.block


def test_sec2_client_salt_rejected_or_stripped(stack) -> None:
    gov, urls = stack.gov, stack.urls
    body = {"model": "smollm2", "prompt": "hi", "max_tokens": 2,
            "cache_salt": gov.salt_for("acme")}
    r = HTTP.post(urls["strict"] + "/v1/completions", json=body,
                  headers={"Authorization": f"Bearer {KEYS['beta']}"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "cache_salt"
    # Counted, then written as the tenant's rate-bounded summary record (issue 13).
    assert stack.thread.run(gov.flush_audit_summaries(force=True)) >= 1
    log = gov.config.server.data_dir / "audit.log"
    assert '"client_salt_rejected=' in log.read_text()
    nested = {**body, "extra_body": {"cache_salt": "x"}}
    nested.pop("cache_salt")
    r = HTTP.post(urls["strict"] + "/v1/completions", json=nested,
                  headers={"Authorization": f"Bearer {KEYS['beta']}"})
    assert r.status_code == 400
    # Lenient: stripped, and B's own salt is used — B's warm prompt hits only B's cache
    # (B's namespace starts empty, so the expected count is exactly 0).
    stack.thread.run(gov.rotate("beta", actor="sec2-test"))
    prompt = random_prompt(4 * stack.block)
    a = client(urls["strict"], "acme")
    for _ in range(2):
        a.completions.create(model="smollm2", prompt=prompt, max_tokens=1)
    r = HTTP.post(urls["lenient"] + "/v1/completions",
                  json={**body, "prompt": prompt, "max_tokens": 1},
                  headers={"Authorization": f"Bearer {KEYS['beta']}"})
    assert r.status_code == 200
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    metrics = stack.metrics("lenient")
    assert 'fak_client_cache_salt_total{action="stripped",tenant="beta"}' in metrics


def test_bad_requests_get_openai_errors(stack) -> None:
    urls = stack.urls
    url = urls["strict"] + "/v1/chat/completions"
    auth = {"Authorization": f"Bearer {KEYS['acme']}"}
    cases = [
        ({}, {"messages": [{"role": "user", "content": "x"}]}, 401, None),
        (auth, {"messages": []}, 400, "messages"),
        (auth, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400,
         "max_tokens"),
        (auth, {"messages": [{"role": "user", "content": "x"}], "kv_transfer_params": {}},
         400, "kv_transfer_params"),
        (auth, {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400,
         "temperature"),
        (auth, {"messages": [{"role": "user", "content": "x"}], "model": "nope"}, 404,
         "model"),
    ]
    for headers, body, status, param in cases:
        r = HTTP.post(url, json=body, headers=headers)
        assert r.status_code == status, (body, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["param"] == param
    r = HTTP.post(url, content=b"{not json", headers={**auth,
                                                       "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"]
    r = HTTP.post(url, content=b"x" * (2 << 20), headers=auth)
    assert r.status_code == 413
    assert HTTP.get(urls["strict"] + "/health").status_code == 200


def test_concurrent_streams_four_tenants_accounting(stack) -> None:
    """64 streams from 4 tenants (16 each) finish with exact per-tenant accounting."""
    urls = stack.urls
    before = stack.metrics()
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
    after = stack.metrics()
    for tenant, expected in totals.items():
        assert expected == sum(4 + i % 3 for i in range(16))
        delta = _counter(after, tenant) - _counter(before, tenant)
        assert delta == expected, tenant


def _counter(text: str, tenant: str) -> float:
    prefix = f'fak_completion_tokens_total{{tenant="{tenant}"}} '
    return next((float(line[len(prefix):]) for line in text.splitlines()
                 if line.startswith(prefix)), 0.0)


def test_admin_routes(stack) -> None:
    gov, urls = stack.gov, stack.urls
    admin = {"Authorization": f"Bearer {ADMIN}"}
    assert HTTP.get(urls["strict"] + "/admin/v1/capabilities").status_code == 401
    assert HTTP.get(urls["strict"] + "/admin/v1/capabilities",
                    headers={"Authorization": f"Bearer {KEYS['acme']}"}).status_code == 401
    caps = HTTP.get(urls["strict"] + "/admin/v1/capabilities", headers=admin).json()
    assert caps["cache_salt"] is True and caps["engine_kind"] in ("native", "vllm")
    tenants = HTTP.get(urls["strict"] + "/admin/v1/tenants", headers=admin).json()["data"]
    assert {t["id"] for t in tenants} == set(KEYS)
    assert HTTP.get(urls["strict"] + "/ready").json() == {"ready": True}
    epoch = gov.epochs.get("gamma")
    old_salt = gov.salt_for("gamma")
    r = HTTP.post(urls["strict"] + "/admin/v1/tenants/gamma/rotate", headers=admin)
    assert r.status_code == 200
    record = r.json()
    assert record["event"]["kind"] == "rotate"
    assert record["event"]["evidence"]["new_epoch"] == epoch + 1
    assert gov.epochs.get("gamma") == epoch + 1 and gov.salt_for("gamma") != old_salt
    assert HTTP.post(urls["strict"] + "/admin/v1/tenants/nobody/rotate",
                     headers=admin).status_code == 404
    log = (gov.config.server.data_dir / "audit.log").read_text()
    assert '"kind":"rotate"' in log and old_salt not in log
