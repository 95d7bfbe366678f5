"""The postgres backend in-process, on a real PostgreSQL: migrations, one shared audit log
written by several replicas, verification by DSN, epochs by compare-and-set with acks,
quarantine records readable anywhere, and the stale-epoch bound (issue 15)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from governor.audit.cli import cmd_audit_verify
from governor.cli import main
from governor.config import GovernorConfig, parse_config
from governor.secrets import StartupRefused
from governor.serve import audit_log_config
from governor.store.backend import SharedState, open_shared_state
from governor.store.migrations import migrate
from governor.store.pg_epochs import EpochsStale
from governor.store.pg_log import verify_database
from policies.salts import SaltKey
from schemas.audit import AuditEvent, AuditRecord, AuditState, Evidence
from tests.governor.audit_rig import cancel_a_maintain_behind

from .pg_server import PostgresServer, remove_postgres, start_postgres

SALT_KEY = SaltKey(b"k" * 32)


def config(data_dir: Path, replica: str, dsn_env: str = "FAK_TEST_DSN",
           staleness_ms: int = 300) -> GovernorConfig:
    return parse_config({"server": {"data_dir": str(data_dir)},
                         "audit": {"checkpoint_every_records": 50},
                         "state": {"backend": "postgres", "dsn_env": dsn_env,
                                   "replica_id": replica,
                                   "epoch_max_staleness_ms": staleness_ms}})


@pytest.fixture
def replicas(pg_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
             ) -> Iterator[list[SharedState]]:
    """Two replicas' state, sharing one database, one signing key and one salt key."""
    monkeypatch.setenv("FAK_TEST_DSN", pg_dsn)
    opened = []
    for name in ("r1", "r2"):
        cfg = config(tmp_path, name)
        opened.append(open_shared_state(cfg, audit_log_config(cfg), SALT_KEY))
    yield opened
    for state in opened:
        state.audit.close()
        state.epochs.close()
        state.records.close()


def event(n: int, tenant: str = "acme") -> AuditEvent:
    return AuditEvent(kind="quarantine", actor="admin", state=AuditState.RECORDED,
                      tenant=tenant, request_id=f"req-{n}")


def rotation_event(actor: str) -> object:
    return lambda old, new: AuditEvent(kind="rotate", actor=actor, state=AuditState.RECORDED,
                                       tenant="acme", plan="salt_rotation",
                                       request_id=f"rot-{actor}-{new}",
                                       evidence=Evidence(old_epoch=old, new_epoch=new))


def entries(dsn: str) -> list[AuditRecord]:
    with psycopg.connect(dsn) as conn:
        return [AuditRecord.from_dict(json.loads(bytes(line))["record"])
                for (line,) in conn.execute("SELECT line FROM audit_entries ORDER BY idx")]


def test_migrations_apply_once_and_refuse_a_newer_schema(pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        assert migrate(conn) == [1]
        assert migrate(conn) == []
        conn.execute("INSERT INTO fak_schema_migrations (version) VALUES (99)")
        with pytest.raises(RuntimeError, match="upgrade the governor"):
            migrate(conn)


async def test_two_replicas_append_one_gap_free_log(replicas: list[SharedState],
                                                    pg_dsn: str) -> None:
    a, b = replicas
    records = await asyncio.gather(*(s.audit.append_async(event(n))
                                     for n in range(300) for s in (a, b)))
    assert sorted(r.index for r in records) == list(range(600))
    for s in (a, b):
        s.audit.check_integrity()
        assert s.audit.batches < s.audit.records_written  # group commit
    report = verify_database(pg_dsn)
    assert report.ok and report.records == 600, report.summary()
    stored = {r.index: r for r in entries(pg_dsn)}
    assert all(stored[r.index] == r for r in records)  # each caller got its own record
    assert cmd_audit_verify(pg_dsn) == 0


async def test_a_cancelled_maintain_leaves_the_writer_alive(replicas: list[SharedState],
                                                            pg_dsn: str) -> None:
    """The checkpoint loop cancelled at shutdown while its `maintain_async` waits behind
    queued appends: the writer answers no cancelled call (doing so ended its thread, and
    every later append then waited forever)."""
    audit = replicas[0].audit
    queued, last = await cancel_a_maintain_behind(audit, [event(n) for n in range(600)],
                                                  event(600))
    assert sorted(f.result(0).index for f in queued) == list(range(600)) and last.index == 600
    report = verify_database(pg_dsn)
    assert report.ok and report.records == 601, report.summary()


async def test_rotation_is_compare_and_set_and_confirmed_by_every_live_replica(
        replicas: list[SharedState], pg_dsn: str) -> None:
    a, b = replicas
    before = b.epochs.get("acme")
    confirmed = await a.epochs.rotate("acme", rotation_event("a"), a.audit.append_async)
    assert confirmed.event.kind == "rotation_confirmed"
    assert confirmed.event.state is AuditState.VERIFIED
    assert confirmed.event.reasons == ("replicas_acked=2/2",)
    assert b.epochs.get("acme") == before + 1  # b acknowledged, so it already uses it
    # Concurrent rotations from both replicas: every one a distinct step, no lost update.
    done = await asyncio.gather(*(
        s.epochs.rotate("acme", rotation_event(f"a{n}"), s.audit.append_async)
        for n, s in enumerate((a, b) * 10)))
    steps = sorted(r.event.evidence.new_epoch for r in done if r.event.evidence)
    assert steps == list(range(before + 2, before + 22))
    assert a.epochs.get("acme") == b.epochs.get("acme") == before + 21
    rotates = [r for r in entries(pg_dsn) if r.event.kind == "rotate"]
    assert [r.event.evidence.new_epoch for r in rotates if r.event.evidence] == list(
        range(before + 1, before + 22))  # in log order: one ordered history
    assert verify_database(pg_dsn).ok


async def test_a_replica_that_misses_the_bound_is_named(replicas: list[SharedState],
                                                        pg_dsn: str) -> None:
    a, _ = replicas
    with psycopg.connect(pg_dsn, autocommit=True) as conn:  # alive by heartbeat, never acks
        conn.execute("INSERT INTO replicas (id, host, pid) VALUES ('r9-silent', 'h', 1)")
    deadline = time.monotonic() + 2
    while "r9-silent" not in a.epochs.watcher.live_replicas():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    started = time.monotonic()
    confirmed = await a.epochs.rotate("acme", rotation_event("a"), a.audit.append_async)
    waited = time.monotonic() - started
    assert confirmed.event.state is AuditState.UNVERIFIED
    assert confirmed.event.reasons == ("replicas_acked=2/3", "replica_missed=r9-silent")
    assert 0.3 <= waited < 1.5  # it waited the bound, no longer


async def test_a_forged_notification_changes_nothing(replicas: list[SharedState],
                                                     pg_dsn: str) -> None:
    """Any database login may NOTIFY: a payload is only a wake-up, the tables decide."""
    a, _ = replicas
    before = a.epochs.get("acme")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_notify('fak_epochs', 'acme 99')")
        conn.execute("SELECT pg_notify('fak_acks', 'r9 acme 99')")
    await asyncio.sleep(0.3)
    assert a.epochs.get("acme") == before
    assert a.epochs.watcher.acked("r9", "acme") == -1
    await a.epochs.rotate("acme", rotation_event("a"), a.audit.append_async)
    assert a.epochs.get("acme") == before + 1


async def test_quarantine_records_are_readable_from_every_replica(
        replicas: list[SharedState]) -> None:
    a, b = replicas
    doc = {"id": "q-1", "state": "VERIFIED", "reasons": ["engine_ok"]}
    await a.records.put("q-1", "acme", 7, doc)
    await a.records.put("q-1", "acme", 7, doc)  # idempotent
    assert await b.records.get("q-1") == doc
    assert await b.records.get("q-unknown") is None


def test_tampering_in_the_database_is_named(replicas: list[SharedState], pg_dsn: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    a, _ = replicas
    for n in range(10):
        a.audit.append(event(n))
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.RaiseException, match="append-only"):
            conn.execute("DELETE FROM audit_entries WHERE idx = 3")
        with pytest.raises(psycopg.errors.RaiseException, match="append-only"):
            conn.execute("UPDATE audit_checkpoints SET tree_size = 0")
        # An owner can switch the trigger off; the log still names the edit.
        conn.execute("ALTER TABLE audit_entries DISABLE TRIGGER audit_entries_append_only")
        conn.execute("UPDATE audit_entries SET line = convert_to(replace(convert_from("
                     "line, 'UTF8'), 'req-4', 'req-X'), 'UTF8') WHERE idx = 4")
    report = verify_database(pg_dsn)
    assert not report.ok and report.first_bad_index == 4
    assert cmd_audit_verify(pg_dsn) == 1
    assert "first bad index: 4" in capsys.readouterr().out


def test_cli_verify_and_checkpoint_by_dsn(replicas: list[SharedState], pg_dsn: str,
                                          tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                          ) -> None:
    a, _ = replicas
    for n in range(5):
        a.audit.append(event(n))
    assert main(["audit", "verify", "--dsn-env", "FAK_TEST_DSN"]) == 0
    assert main(["audit", "checkpoint", "--dsn-env", "FAK_TEST_DSN", "--signing-key",
                 str(tmp_path / "audit_signing.key")]) == 0
    anchor = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert anchor["tree_size"] == 5
    (tmp_path / "anchor.json").write_text(json.dumps(anchor))
    assert main(["audit", "verify", "--dsn-env", "FAK_TEST_DSN", "--anchor",
                 str(tmp_path / "anchor.json")]) == 0
    capsys.readouterr()
    assert main(["audit", "checkpoint", "--dsn-env", "FAK_TEST_DSN"]) == 0  # stored one
    assert json.loads(capsys.readouterr().out)["tree_size"] == 5
    assert main(["audit", "verify"]) == 2  # neither a log nor a DSN


def test_a_replica_with_other_keys_is_refused(replicas: list[SharedState], tmp_path: Path
                                              ) -> None:
    other = config(tmp_path / "other", "r3")
    with pytest.raises(Exception, match="signing key is not the deployment's"):
        open_shared_state(other, audit_log_config(other), SALT_KEY)
    same_log_key = config(tmp_path, "r3")
    with pytest.raises(Exception, match="salt key is not the deployment's"):
        open_shared_state(same_log_key, audit_log_config(same_log_key), SaltKey(b"z" * 32))


def test_missing_dsn_refuses_the_start(tmp_path: Path) -> None:
    cfg = config(tmp_path, "r1", dsn_env="FAK_NOT_SET_ANYWHERE")
    os.environ.pop("FAK_NOT_SET_ANYWHERE", None)
    with pytest.raises(StartupRefused, match="FAK_NOT_SET_ANYWHERE"):
        open_shared_state(cfg, audit_log_config(cfg), SALT_KEY)


# -- the database goes away: bounded staleness, then fail closed, then resume -----------


@pytest.fixture
def own_postgres() -> Iterator[PostgresServer]:
    """A server of its own, to stop and start without disturbing the other tests."""
    server = start_postgres()
    yield server
    remove_postgres(server)


async def test_database_down_fails_closed_after_the_bound_and_resumes(
        own_postgres: PostgresServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAK_TEST_DSN", own_postgres.create_database())
    cfg = config(tmp_path, "r1", staleness_ms=400)
    state = open_shared_state(cfg, audit_log_config(cfg), SALT_KEY)
    try:
        await state.epochs.rotate("acme", rotation_event("a"), state.audit.append_async)
        epoch = state.epochs.get("acme")
        await asyncio.to_thread(own_postgres.stop, "immediate")
        stopped = time.monotonic()
        pending = [asyncio.ensure_future(state.audit.append_async(event(n))) for n in range(20)]
        served_after_stop = False
        while True:
            try:
                assert state.epochs.get("acme") == epoch
                served_after_stop = True
            except EpochsStale as exc:
                assert exc.status == 503 and "stale salt" in exc.message
                break
            await asyncio.sleep(0.01)
        refused_after = time.monotonic() - stopped
        assert served_after_stop and 0.05 < refused_after <= 0.4 + 0.05, refused_after
        assert state.audit.problem() is not None or state.epochs.problem() is not None
        await asyncio.sleep(1.0)
        assert not any(p.done() for p in pending)  # appends wait, they do not fail
        await asyncio.to_thread(own_postgres.start)
        records = await asyncio.wait_for(asyncio.gather(*pending), 30)
        deadline = time.monotonic() + 10
        while state.epochs.problem() is not None:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        assert state.epochs.get("acme") == epoch
    finally:
        state.audit.close()
        state.epochs.close()
        state.records.close()
    log = entries(os.environ["FAK_TEST_DSN"])
    ids = [(r.event.kind, r.event.request_id) for r in log]
    assert len(ids) == len(set(ids))  # nothing written twice
    assert all(log[r.index] == r for r in records)  # nothing acknowledged lost
    assert verify_database(os.environ["FAK_TEST_DSN"]).ok

