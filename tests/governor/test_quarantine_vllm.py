"""The quarantine service over a ridden vLLM: real loopback HTTP to the 0.32.0 imitation,
real ZeroMQ KV events (vLLM's wire, seqs chosen by the test), the admin routes and the CLI.

The imitation never reports a prefix hit, so no flush here can be VERIFIED (the positive
control misses); these tests prove the FAILED / UNVERIFIED / REFUSED paths and what each
records. A VERIFIED flush is tests/integration/test_quarantine_vllm.py, on a real vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import zmq
from aiohttp import web

from adapters.vllm.capabilities import VLLMDeclarations
from adapters.vllm.dev_control import DevControlConfig, VLLMDevControl
from adapters.vllm.http_driver import VLLMDriver, VLLMHTTPConfig
from adapters.vllm.kv_subscriber import KVEventSubscriber, KVSubscriberConfig, SyncState
from governor.admin_client import add_quarantine_parser, add_tenants_parser, cmd_quarantine
from governor.auth import sha256_hex
from governor.config import parse_config
from governor.http.app import build_app
from governor.quarantine.executors import QuarantineConfig
from governor.quarantine.routes import add_quarantine_routes
from governor.quarantine.service import QuarantineRequest, QuarantineService, SpanInput
from governor.serve import build_governor
from governor.state import Governor
from native_engine.serve.kv_wire import encode_batch
from schemas.audit import AuditState
from schemas.kv_events import AllBlocksCleared, BlockRemoved, KVEvent
from tests.adapters.vllm_imitation import Imitation, start_imitation

ADMIN = "admin-token"
FAST = QuarantineConfig(drain_timeout_s=0.6, retry_interval_s=0.1, kv_timeout_s=1.5,
                        probe_timeout_s=10.0)


class SeqPublisher:
    """A ZeroMQ PUB speaking vLLM's KV-event wire, with the seq of each batch chosen by the
    test, so a lost batch (a gap) can be produced on purpose."""

    def __init__(self) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        self.port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.next_seq = 0

    def send(self, events: list[KVEvent], skip: int = 0) -> int:
        seq = self.next_seq + skip
        payload = encode_batch(time.time(), events)
        self._sock.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])
        self.next_seq = seq + 1
        return seq

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()


@dataclass
class Rig:
    state: Imitation
    gov: Governor
    service: QuarantineService
    publisher: SeqPublisher
    kv: KVEventSubscriber
    data_dir: Path

    def sent(self, method: str, path: str) -> list[object]:
        return [body for m, p, _, body in self.state.received if (m, p) == (method, path)]

    def audit_lines(self) -> list[dict]:
        return [json.loads(line)["record"]
                for line in (self.data_dir / "audit.log").read_text().splitlines()]


async def _rig(tmp_path: Path, *, dev_mode: bool, prompt_details: bool = True,
               reset_body: str = '{"success":true}') -> tuple[Rig, web.AppRunner, VLLMDriver]:
    state = Imitation(reset_body=reset_body, prompt_details=prompt_details)
    runner, base_url = await start_imitation(state)
    publisher = SeqPublisher()
    kv = KVEventSubscriber(KVSubscriberConfig(endpoint=f"tcp://127.0.0.1:{publisher.port}",
                                              mode="connect", topic="kv"))
    dev = VLLMDevControl(DevControlConfig(base_url, enabled=True), lambda call: None)
    driver = VLLMDriver(VLLMHTTPConfig(base_url),
                        VLLMDeclarations(dev_mode_reset=dev_mode,
                                         prompt_tokens_details=prompt_details,
                                         kv_probe_timeout_s=5.0),
                        kv=kv, reset_route=dev if dev_mode else None)
    await driver.start()
    publisher.send([BlockRemoved((1,), "GPU")])  # seq 0: the subscriber is SYNCED from here
    for _ in range(100):
        if kv.state() is SyncState.SYNCED:
            break
        await asyncio.sleep(0.02)
    tenants = [{"id": t, "api_key_sha256": [sha256_hex(f"key-{t}")]} for t in ("acme", "beta")]
    config = parse_config({"server": {"data_dir": str(tmp_path), "admin_token_sha256":
                                      sha256_hex(ADMIN)},
                           "engine": {"kind": "vllm", "base_url": base_url},
                           "tenants": tenants})
    gov = build_governor(config, driver, create_key=True)
    rig = Rig(state, gov, QuarantineService(gov, FAST), publisher, kv, tmp_path)
    return rig, runner, driver


@contextlib.asynccontextmanager
async def rig_of(tmp_path: Path, **kwargs: object) -> AsyncIterator[Rig]:
    rig, runner, driver = await _rig(tmp_path, **kwargs)  # type: ignore[arg-type]
    try:
        yield rig
        rig.service.check_integrity()
        rig.gov.audit.check_integrity()
    finally:
        await driver.close()
        rig.publisher.close()
        rig.gov.audit.close()
        await runner.cleanup()


@contextlib.asynccontextmanager
async def publish_on_reset(rig: Rig, skip: int = 0) -> AsyncIterator[None]:
    """Play vLLM's part: after a successful reset, publish `AllBlocksCleared` (`skip`
    batches later than the next seq: a lost batch)."""

    async def watch() -> None:
        while not rig.sent("POST", "/reset_prefix_cache"):
            await asyncio.sleep(0.01)
        rig.publisher.send([AllBlocksCleared()], skip=skip)

    task = asyncio.create_task(watch())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def request(text: str = "a poisoned prompt", **kwargs: object) -> QuarantineRequest:
    return QuarantineRequest(tenant="acme", span=SpanInput(text=text), reason="ticket-42",
                             **kwargs)  # type: ignore[arg-type]


async def test_require_exact_is_refused_audited_and_sends_nothing(tmp_path: Path) -> None:
    async with rig_of(tmp_path, dev_mode=True) as rig:
        before = len(rig.state.received)
        record = await rig.service.quarantine(request(require_exact=True))
        assert (record.state, record.plan) == (AuditState.REFUSED, "refuse")
        assert "exact_required_but_unsupported" in record.reasons
        assert len(rig.state.received) == before  # no probe, no reset
        logged = rig.audit_lines()[-1]
        assert logged["index"] == record.audit_index
        assert (logged["event"]["kind"], logged["event"]["state"]) == ("quarantine", "REFUSED")
        assert logged["event"]["span"] == {"digest": record.span.digest, "length": 0}
        assert "span_length_unmeasured" in logged["event"]["reasons"]
        assert rig.service.get(record.id) == record


async def test_flush_while_requests_run_is_failed_never_verified(tmp_path: Path) -> None:
    async with rig_of(tmp_path, dev_mode=True, reset_body='{"success":false}') as rig:
        started = time.monotonic()
        record = await rig.service.quarantine(request())
        assert record.plan == "whole_prefix_flush" and record.degraded
        assert record.state is AuditState.FAILED
        assert record.evidence.engine_result == "reset_refused_requests_running"
        assert "drain_deadline_passed" in record.reasons
        attempts = len(rig.sent("POST", "/reset_prefix_cache"))
        assert attempts >= 3 and f"reset_attempts={attempts}" in record.reasons
        assert time.monotonic() - started < FAST.drain_timeout_s + FAST.probe_timeout_s
        assert record.evidence.probe_after_cached_tokens is None  # no probe after a failure


async def test_flush_with_clear_but_no_positive_control_is_unverified(tmp_path: Path) -> None:
    async with rig_of(tmp_path, dev_mode=True) as rig:
        async with publish_on_reset(rig):
            record = await rig.service.quarantine(request())
        assert record.state is AuditState.UNVERIFIED
        ev = record.evidence
        assert (ev.engine_result, ev.kv_events) == ("reset_succeeded", "all_blocks_cleared")
        assert (ev.kv_seq_from, ev.kv_seq_to) == (1, 1)
        assert (ev.probe_control_cached_tokens, ev.probe_after_cached_tokens) == (0, 0)
        assert "probe_control_miss" in record.reasons
        probes = rig.sent("POST", "/v1/completions")[-3:]  # control twice, then after
        salt = rig.gov.salt_for("acme")
        assert [p["cache_salt"] for p in probes] == [salt] * 3  # type: ignore[index]
        assert record.span.length == probes[-1]["prompt"].count(" ") + 1  # type: ignore[index]


async def test_kv_seq_gap_is_never_verified(tmp_path: Path) -> None:
    async with rig_of(tmp_path, dev_mode=True) as rig:
        async with publish_on_reset(rig, skip=2):
            record = await rig.service.quarantine(request())
        assert record.state is AuditState.UNVERIFIED
        assert record.evidence.kv_events == "kv_seq_gap"
        assert "removal_unconfirmed:kv_seq_gap" in record.reasons


async def test_no_clear_event_is_unverified(tmp_path: Path) -> None:
    async with rig_of(tmp_path, dev_mode=True) as rig:
        record = await rig.service.quarantine(request())
        assert record.state is AuditState.UNVERIFIED
        assert record.evidence.kv_events == "kv_no_all_blocks_cleared"


async def test_no_prompt_token_details_is_unverified(tmp_path: Path) -> None:
    async with rig_of(tmp_path, dev_mode=True, prompt_details=False) as rig:
        async with publish_on_reset(rig):
            record = await rig.service.quarantine(request())
        assert record.state is AuditState.UNVERIFIED
        assert "probe_unavailable_no_prompt_tokens_details" in record.reasons
        assert "probe_unavailable" in record.reasons
        assert record.evidence.kv_events == "all_blocks_cleared"
        # the after-probe still went out: it is the step that makes vLLM publish the clear
        assert len(rig.sent("POST", "/v1/completions")) >= 1


async def test_salt_rotation_moves_only_that_tenant(tmp_path: Path) -> None:
    async with rig_of(tmp_path, dev_mode=False) as rig:
        old_salt, beta_salt = rig.gov.salt_for("acme"), rig.gov.salt_for("beta")
        record = await rig.service.quarantine(request())
        assert (record.plan, record.degraded) == ("salt_rotation", True)
        assert (record.evidence.old_epoch, record.evidence.new_epoch) == (0, 1)
        assert rig.gov.epochs.get("acme") == 1 and rig.gov.epochs.get("beta") == 0
        new_salt = rig.gov.salt_for("acme")
        assert new_salt != old_salt and rig.gov.salt_for("beta") == beta_salt
        salts = [p["cache_salt"] for p in rig.sent("POST", "/v1/completions")[-3:]]
        assert salts == [old_salt, old_salt, new_salt]  # control in the old, probe in the new
        assert rig.sent("POST", "/reset_prefix_cache") == []
        assert record.state is AuditState.UNVERIFIED  # the imitation never shows a hit
        assert record.evidence.kv_events == "namespace_replaced"
        kinds = [(r["event"]["kind"], r["event"]["state"]) for r in rig.audit_lines()[-2:]]
        assert kinds == [("rotate", "RECORDED"), ("quarantine", "UNVERIFIED")]


async def test_audit_log_never_holds_the_span(tmp_path: Path) -> None:
    """SEC-14: canary text in the span; neither it, its plain hash nor a salt is logged."""
    canary = "CANARY-7f3a9c-do-not-log"
    async with rig_of(tmp_path, dev_mode=True) as rig:
        async with publish_on_reset(rig):
            record = await rig.service.quarantine(request(f"secret {canary} text"))
        salt = rig.gov.salt_for("acme")
        rig.gov.audit.checkpoint()
        exported = rig.gov.audit.export_checkpoint()
    dumped = json.dumps(record.to_json())
    for blob in [*(p.read_text() for p in tmp_path.glob("audit*")), exported, dumped]:
        assert canary not in blob and salt not in blob
        assert hashlib.sha256(f"secret {canary} text".encode()).hexdigest() not in blob


async def _serve(gov: Governor) -> tuple[web.AppRunner, str]:
    app = build_app(gov)
    service = add_quarantine_routes(app, FAST)
    assert add_quarantine_routes(app) is service  # idempotent: build_app may register it
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


async def test_admin_routes_and_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    async with rig_of(tmp_path, dev_mode=True) as rig:
        runner, url = await _serve(rig.gov)
        admin = {"Authorization": f"Bearer {ADMIN}"}
        body = {"tenant": "acme", "span": {"token_ids": [5, 6, 7]}, "reason": "ticket-1",
                "require_exact": True}
        try:
            async with httpx.AsyncClient(base_url=url) as http:
                assert (await http.post("/admin/v1/quarantine", json=body)).status_code == 401
                tenant_key = {"Authorization": "Bearer key-acme"}
                r = await http.post("/admin/v1/quarantine", json=body, headers=tenant_key)
                assert r.status_code == 401
                r = await http.post("/admin/v1/quarantine", json={**body, "reason": "Bad words"},
                                    headers=admin)
                assert r.status_code == 400 and r.json()["error"]["param"] == "reason"
                r = await http.post("/admin/v1/quarantine", json={**body, "start": 3},
                                    headers=admin)
                assert r.status_code == 400 and r.json()["error"]["param"] == "start"
                r = await http.post("/admin/v1/quarantine", json={**body, "tenant": "nobody"},
                                    headers=admin)
                assert r.status_code == 404
                r = await http.post("/admin/v1/quarantine", json=body, headers=admin)
                assert r.status_code == 200
                record = r.json()
                assert (record["state"], record["span"]["length"]) == ("REFUSED", 3)
                shown = await http.get(f"/admin/v1/quarantine/{record['id']}", headers=admin)
                assert shown.json() == record
                missing = await http.get("/admin/v1/quarantine/q-none", headers=admin)
                assert missing.status_code == 404

            monkeypatch.setenv("FAK_TEST_ADMIN", ADMIN)
            parser = _cli()
            argv = ["quarantine", "--url", url, "--admin-token-env", "FAK_TEST_ADMIN",
                    "--tenant", "acme", "--token-ids", "5,6,7", "--reason", "ticket-2",
                    "--require-exact"]
            assert await asyncio.to_thread(cmd_quarantine, parser.parse_args(argv)) == 1
            refused = json.loads(capsys.readouterr().out)
            assert refused["state"] == "REFUSED"
            show = ["quarantine", "--url", url, "--admin-token-env", "FAK_TEST_ADMIN", "show",
                    refused["id"]]
            assert await asyncio.to_thread(cmd_quarantine, parser.parse_args(show)) == 0
            assert json.loads(capsys.readouterr().out) == refused
            monkeypatch.setenv("FAK_TEST_ADMIN", "wrong")
            assert await asyncio.to_thread(cmd_quarantine, parser.parse_args(show)) == 2
            assert "HTTP 401" in capsys.readouterr().err
        finally:
            await runner.cleanup()


def _cli():
    import argparse

    parser = argparse.ArgumentParser(prog="fak")
    sub = parser.add_subparsers(dest="command", required=True)
    add_quarantine_parser(sub)
    add_tenants_parser(sub)
    return parser
