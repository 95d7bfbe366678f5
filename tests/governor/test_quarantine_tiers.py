"""Quarantine through the governor on a native engine with KV tiers (tiny random Llama, fp32):
a span resident in the device pool, the host tier and the disk tier is VERIFIED, leaves no
host copy and no file of it, and every other tenant's blocks stay in every tier; a tier that
cannot be cleared makes the record FAILED; a rotation ages the old epoch out first."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from aiohttp import web

from adapters.native import NativeDriver, NativeDriverConfig
from governor.auth import sha256_hex
from governor.config import parse_config
from governor.http.app import build_app
from governor.quarantine.routes import add_quarantine_routes
from governor.serve import build_governor
from governor.state import Governor
from native_engine.engine import LLMEngine
from native_engine.kvcache.tiers import TieredKV
from tests.http_client import HTTP
from tests.native_engine.tier_helpers import block_bytes_of, tier_config
from tests.native_engine.tiny_model import random_model
from tests.prompts import FreshPrompts

from .server_thread import ServerThread, free_port

ADMIN = "admin-token"
TENANTS = ("acme", "beta")
BS = 16


@dataclass
class Stack:
    thread: ServerThread
    gov: Governor
    url: str
    engine: LLMEngine

    @property
    def tiers(self) -> TieredKV:
        assert self.engine.tiers is not None
        return self.engine.tiers

    def complete(self, tenant: str, prompt: str) -> int:
        r = HTTP.post(self.url + "/v1/completions", timeout=120,
                      headers={"Authorization": f"Bearer key-{tenant}"},
                      json={"model": "smollm2", "prompt": prompt, "max_tokens": 1,
                             "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    def quarantine(self, **body: object) -> dict:
        r = HTTP.post(self.url + "/admin/v1/quarantine", json=body, timeout=300,
                      headers={"Authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 200, r.text
        return r.json()

    def on_engine(self, fn):  # type: ignore[no-untyped-def]
        driver = self.gov.driver
        return self.thread.run(driver.engine.call(fn))  # type: ignore[attr-defined]

    def evict_all(self) -> None:
        """Push every cached block out of the device pool (down into the tiers)."""
        def push(e: LLMEngine) -> None:
            assert e.cache is not None and e.tiers is not None
            e.cache.evict(e.pool.num_blocks)
            e.tiers.drain()
        self.on_engine(push)

    def chain(self, tenant: str, text: str) -> set[bytes]:
        tokens = self.gov.driver.serving.prepare(  # type: ignore[attr-defined]
            "completions", {"prompt": text, "max_tokens": 1}).prompt_ids
        return set(self.tiers.chain(self.gov.salt_for(tenant), tokens, len(tokens) // BS))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    data_dir = tmp_path_factory.mktemp("gov")
    loaded = random_model(seed=11)
    config = tier_config(block_bytes_of(loaded, BS), host_blocks=8,
                         disk_dir=data_dir / "kv", block_size=BS, num_blocks=96,
                         max_model_len=512, scheduling_policy="priority")
    thread = ServerThread()
    driver = NativeDriver(NativeDriverConfig(engine=config), loaded=loaded)
    thread.run(driver.start())
    assert driver.engine is not None
    engine = driver.engine.engine
    gov_config = parse_config({
        "server": {"data_dir": str(data_dir), "admin_token_sha256": sha256_hex(ADMIN)},
        "engine": {"kind": "native"},
        "tenants": [{"id": t, "api_key_sha256": [sha256_hex(f"key-{t}")]} for t in TENANTS]})
    gov = build_governor(gov_config, driver, create_key=True)
    port = free_port()

    async def start() -> web.AppRunner:
        app = build_app(gov)
        add_quarantine_routes(app)
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner

    runner = thread.run(start())
    yield Stack(thread, gov, f"http://127.0.0.1:{port}", engine)
    thread.run(runner.cleanup())
    thread.run(driver.close())
    gov.audit.close()
    thread.stop()


words = FreshPrompts().words


def test_span_in_all_three_tiers_is_verified_and_gone_everywhere(stack: Stack) -> None:
    poisoned, older = words(48), words(48)  # 96 bytes: 6 blocks of 16
    assert stack.complete("beta", older) == 0
    stack.evict_all()
    assert stack.complete("acme", poisoned) == 0
    assert stack.complete("beta", poisoned) == 0  # the same bytes in another namespace
    stack.evict_all()  # host RAM (8 blocks) keeps the newest, the rest moves on to disk
    assert stack.complete("acme", poisoned[:40]) > 0  # its head is back in the device pool
    mine = stack.chain("acme", poisoned)
    theirs = stack.chain("beta", poisoned) | stack.chain("beta", older)
    before = stack.on_engine(lambda e: e.tiers.resident())
    assert mine & before["CPU"] and mine & before["DISK"]
    assert theirs & before["CPU"] and theirs & before["DISK"]

    record = stack.quarantine(tenant="acme", span={"text": poisoned}, reason="ticket-200")
    assert (record["plan"], record["state"]) == ("exact", "VERIFIED"), record
    assert record["evidence"]["kv_events"] == "block_removed_set_ok"  # every medium's
    reasons = set(record["reasons"])
    assert {"tier_cpu_cleared_others_unchanged", "tier_disk_cleared_others_unchanged"} <= reasons
    assert not any(r.endswith("removed_blocks=0") for r in reasons)

    after = stack.on_engine(lambda e: e.tiers.resident())
    assert not mine & (after["CPU"] | after["DISK"])
    assert not [d for d in mine if stack.tiers.disk.path_of(d).exists()]  # type: ignore[union-attr]
    for medium in ("CPU", "DISK"):
        assert theirs & after[medium] == theirs & before[medium]
    assert stack.complete("beta", poisoned) > 0
    assert stack.complete("acme", poisoned) == 0
    stack.on_engine(lambda e: e.check_integrity())


def test_a_tier_that_cannot_be_cleared_makes_the_record_failed(stack: Stack) -> None:
    poisoned = words(48)
    assert stack.complete("acme", poisoned) == 0
    stack.evict_all()
    for _ in range(2):  # newer blocks push the span out of host RAM, onto disk
        stack.complete("beta", words(48))
    stack.evict_all()
    disk = stack.tiers.disk
    assert disk is not None
    stuck = disk.path_of(sorted(stack.chain("acme", poisoned) & set(
        stack.on_engine(lambda e: e.tiers.resident())["DISK"]))[0])
    stuck.unlink()
    (stuck / "pinned").mkdir(parents=True)  # its path can no longer be unlinked
    try:
        record = stack.quarantine(tenant="acme", span={"text": poisoned}, reason="ticket-201")
        assert record["state"] == "FAILED", record
        assert "tier_disk_not_cleared" in record["reasons"]
    finally:
        (stuck / "pinned").rmdir()
        stuck.rmdir()
    # Once the path can be deleted the span can be quarantined.
    assert stack.quarantine(tenant="acme", span={"text": poisoned},
                            reason="ticket-202")["state"] == "VERIFIED"
    stack.on_engine(lambda e: e.check_integrity())


def test_rotation_ages_the_old_epoch_out_first(stack: Stack) -> None:
    text = words(48)
    assert stack.complete("beta", text) == 0 and stack.complete("beta", text) > 0
    old_salt = stack.gov.salt_for("beta")
    r = HTTP.post(stack.url + "/admin/v1/tenants/beta/rotate", timeout=30,
                  headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200, r.text
    assert stack.complete("beta", text) == 0  # SEC-10: the new salt misses
    stack.evict_all()  # the old epoch's blocks are dropped, not moved down
    resident = stack.on_engine(lambda e: e.tiers.resident())
    tokens = stack.gov.driver.serving.prepare(  # type: ignore[attr-defined]
        "completions", {"prompt": text, "max_tokens": 1}).prompt_ids
    stale = set(stack.tiers.chain(old_salt, tokens, len(tokens) // BS))
    new = set(stack.tiers.chain(stack.gov.salt_for("beta"), tokens, len(tokens) // BS))
    assert not stale & (resident["CPU"] | resident["DISK"])
    assert new & (resident["CPU"] | resident["DISK"])
