"""Quarantine on the real native engine behind the governor: exact-span eviction VERIFIED
against the radix tree and the canary probe, other tenants and paths untouched, SEC-10 by
rotation, SEC-14 on the audit log, and the `fak` admin commands end to end."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiohttp import web

from adapters.native import NativeDriver, NativeDriverConfig
from governor.admin_client import (
    add_quarantine_parser,
    add_tenants_parser,
    cmd_quarantine,
    cmd_tenants,
)
from governor.auth import sha256_hex
from governor.config import parse_config
from governor.http.app import build_app
from governor.quarantine.routes import add_quarantine_routes
from governor.quarantine.service import QuarantineService
from governor.serve import build_governor
from governor.state import Governor
from native_engine.config import EngineConfig
from tests.http_client import HTTP
from tests.prompts import FreshPrompts

from .server_thread import ServerThread, free_port

pytestmark = pytest.mark.slow

ADMIN = "admin-token"
TENANTS = ("acme", "beta")


@dataclass
class Stack:
    thread: ServerThread
    gov: Governor
    service: QuarantineService
    url: str
    data_dir: Path

    def complete(self, tenant: str, prompt: str) -> int:
        """One greedy one-token completion through the governor; its cached_tokens."""
        r = HTTP.post(self.url + "/v1/completions", timeout=300,
                      headers={"Authorization": f"Bearer key-{tenant}"},
                      json={"model": "smollm2", "prompt": prompt, "max_tokens": 1,
                             "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    def quarantine(self, **body: object) -> dict:
        r = HTTP.post(self.url + "/admin/v1/quarantine", json=body, timeout=600,
                      headers={"Authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 200, r.text
        return r.json()

    def audit_text(self) -> str:
        return "".join(p.read_text() for p in sorted(self.data_dir.glob("audit.*"))
                       if p.suffix in (".log", ".checkpoints"))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    data_dir = tmp_path_factory.mktemp("gov")
    thread = ServerThread()
    driver = NativeDriver(NativeDriverConfig(engine=EngineConfig(
        num_blocks=256, block_size=16, max_model_len=512, scheduling_policy="priority")))
    thread.run(driver.start())
    config = parse_config({
        "server": {"data_dir": str(data_dir), "admin_token_sha256": sha256_hex(ADMIN)},
        "engine": {"kind": "native"},
        "tenants": [{"id": t, "api_key_sha256": [sha256_hex(f"key-{t}")]} for t in TENANTS]})
    gov = build_governor(config, driver, create_key=True)
    port = free_port()

    async def start() -> tuple[web.AppRunner, QuarantineService]:
        app = build_app(gov)
        service = add_quarantine_routes(app)
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner, service

    runner, service = thread.run(start())
    yield Stack(thread, gov, service, f"http://127.0.0.1:{port}", data_dir)
    thread.run(runner.cleanup())
    thread.run(driver.close())
    gov.audit.close()
    thread.stop()


words = FreshPrompts().words


def tokens_of(stack: Stack, text: str) -> list[int]:
    serving = stack.gov.driver.serving  # type: ignore[attr-defined]
    return serving.prepare("completions", {"prompt": text, "max_tokens": 1}).prompt_ids


def check_engine(stack: Stack) -> None:
    engine = stack.gov.driver.engine  # type: ignore[attr-defined]
    stack.thread.run(engine.call(lambda e: e.cache.check_integrity()))
    stack.service.check_integrity()
    stack.gov.audit.check_integrity()


def test_exact_eviction_keeps_other_tenants_and_paths(stack: Stack) -> None:
    poisoned, other = words(40), words(40)
    assert stack.complete("acme", other) == 0 and stack.complete("acme", other) > 0
    assert stack.complete("beta", poisoned) == 0 and stack.complete("beta", poisoned) > 0
    assert stack.complete("acme", poisoned) == 0  # resident for acme from here

    record = stack.quarantine(tenant="acme", span={"text": poisoned}, reason="ticket-100")
    assert (record["plan"], record["degraded"], record["state"]) == ("exact", False, "VERIFIED")
    ev = record["evidence"]
    assert ev["probe_control_cached_tokens"] > 0 and ev["probe_after_cached_tokens"] == 0
    assert ev["engine_result"].startswith("evicted_tokens=")
    assert int(ev["engine_result"].split("=")[1]) > 0
    assert ev["kv_events"] == "block_removed_set_ok"
    assert {"span_resident_before", "radix_other_namespaces_unchanged"} <= set(record["reasons"])

    assert stack.complete("beta", poisoned) > 0  # the other tenant's copy stays
    assert stack.complete("acme", other) > 0  # the tenant's other path stays
    assert stack.complete("acme", poisoned) == 0  # the span is gone, probe copy included
    check_engine(stack)


def test_mid_span_eviction_keeps_the_prefix(stack: Stack) -> None:
    prompt = words(40)
    tokens = tokens_of(stack, prompt)
    start = 12
    record = stack.quarantine(tenant="acme", span={"token_ids": tokens}, start=start,
                              reason="ticket-101", require_exact=True)
    assert (record["plan"], record["state"]) == ("exact", "VERIFIED")
    assert record["span"]["length"] == len(tokens) and record["start"] == start
    ev = record["evidence"]
    assert ev["probe_control_cached_tokens"] > start >= ev["probe_after_cached_tokens"]
    assert "span_cached_by_control" in record["reasons"]  # it was not resident before
    assert stack.complete("acme", prompt) == start  # tokens before `start` stay cached
    check_engine(stack)


def test_chat_messages_span_is_cut_on_the_rendered_tokens(stack: Stack) -> None:
    messages = [{"role": "user", "content": words(30)}]
    r = HTTP.post(stack.url + "/v1/chat/completions", timeout=300,
                  headers={"Authorization": "Bearer key-acme"},
                  json={"model": "smollm2", "messages": messages, "max_tokens": 1})
    assert r.status_code == 200, r.text
    record = stack.quarantine(tenant="acme", span={"messages": messages}, reason="ticket-103")
    assert (record["plan"], record["state"]) == ("exact", "VERIFIED")
    assert "span_resident_before" in record["reasons"]  # the chat request cached these tokens
    serving = stack.gov.driver.serving  # type: ignore[attr-defined]
    rendered = serving.prepare("chat", {"messages": messages, "max_tokens": 1}).prompt_ids
    assert record["span"]["length"] == len(rendered)
    check_engine(stack)


def test_rotation_route_sec10(stack: Stack, monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    """SEC-10: warm, hit, rotate (`fak tenants rotate`), miss; the entry has both epochs."""
    prompt = words(40)
    assert stack.complete("beta", prompt) == 0 and stack.complete("beta", prompt) > 0
    monkeypatch.setenv("FAK_TEST_ADMIN", ADMIN)
    args = _cli().parse_args(["tenants", "rotate", "beta", "--url", stack.url,
                              "--admin-token-env", "FAK_TEST_ADMIN"])
    old = stack.gov.epochs.get("beta")
    assert cmd_tenants(args) == 0
    rotated = json.loads(capsys.readouterr().out)
    assert rotated["event"]["evidence"]["old_epoch"] == old
    assert rotated["event"]["evidence"]["new_epoch"] == old + 1
    assert stack.complete("beta", prompt) == 0
    lines = (stack.data_dir / "audit.log").read_text().splitlines()
    entry = json.loads(lines[rotated["index"]])["record"]["event"]
    assert (entry["kind"], entry["tenant"]) == ("rotate", "beta")
    assert (entry["evidence"]["old_epoch"], entry["evidence"]["new_epoch"]) == (old, old + 1)


def test_audit_log_never_holds_span_text_or_tokens(stack: Stack, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """SEC-14 through `fak quarantine`: a canary string in the span never reaches the log."""
    canary = "zqxcanary" + words(3).replace(" ", "")
    text = f"{words(12)} {canary} {words(12)}"
    monkeypatch.setenv("FAK_TEST_ADMIN", ADMIN)
    args = _cli().parse_args(["quarantine", "--url", stack.url, "--admin-token-env",
                              "FAK_TEST_ADMIN", "--tenant", "acme", "--text", text,
                              "--reason", "ticket-102"])
    code = cmd_quarantine(args)
    record = json.loads(capsys.readouterr().out)
    assert code == (0 if record["state"] == "VERIFIED" else 1)
    assert record["state"] == "VERIFIED"
    tokens = tokens_of(stack, text)
    stack.gov.audit.checkpoint()
    logged = stack.audit_text()
    assert canary not in logged and text not in logged
    assert json.dumps(tokens)[1:-1] not in logged and ",".join(map(str, tokens)) not in logged
    assert stack.gov.salt_for("acme") not in logged
    assert record["span"]["digest"] in logged


def _cli() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fak")
    sub = parser.add_subparsers(dest="command", required=True)
    add_quarantine_parser(sub)
    add_tenants_parser(sub)
    return parser
