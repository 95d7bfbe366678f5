"""One audit log for the deployment, in PostgreSQL: the same entries (canonical JSON lines,
Ed25519 signatures, RFC 9162 tree) and checkpoints as the file log, written by any replica.

Appends go to one writer thread per replica, which commits everything pending in one
transaction (group commit: one WAL flush). Each transaction first locks the single
`audit_head` row, so the entries of two replicas are totally ordered and no index is ever
written twice; the head holds the size and the Merkle frontier, so a replica appends after
another's entries without reading them. A rotation is a compare-and-set on
`tenant_epochs` in the same transaction as its record (and its NOTIFY): the epoch changes
exactly when the record does.

Connection loss: the writer keeps the batch, reconnects with backoff and retries; every
queued operation carries an `op_id` (a unique column), so when a commit's outcome is unknown
the writer first looks its ids up — a batch is committed all or nothing — and never writes a
record twice. A caller is answered only after the commit: nothing acknowledged is lost,
also when a replica is killed mid-append (its open transaction is rolled back).

`open` verifies the whole log before the first append, as the file writer does
(governor.store.pg_log, which `fak audit verify` uses by DSN too).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

import psycopg
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from governor.audit import merkle
from governor.audit.anchor import export_anchor
from governor.audit.entry import (
    AuditLogError,
    canonical_json,
    encode_line,
    raw_public_key,
    sign_checkpoint,
)
from governor.audit.log import AuditLogConfig, claim, resolve_call
from governor.audit.verify import AuditLogCorrupt
from governor.store.connect import TRANSIENT, Backoff, connect, first_line
from governor.store.pg_log import Head, lock_head, store_head, verify_connection
from schemas.audit import AuditEvent, AuditRecord, SignedCheckpoint

log = logging.getLogger("fak.store.audit")
T = TypeVar("T")


@dataclass(slots=True)
class _Op:
    """One queued write. `kind`: append (an event), rotate (a tenant and the event for
    (old, new)), sql (an idempotent statement), call (work on the writer thread)."""

    kind: str
    done: Future[Any]
    event: AuditEvent | None = None
    tenant: str | None = None
    event_for: Callable[[int, int], AuditEvent] | None = None
    sql: str | None = None
    params: tuple[Any, ...] = ()
    action: Callable[[psycopg.Connection], Any] | None = None
    op_id: uuid.UUID = field(default_factory=uuid.uuid4)


@dataclass(frozen=True, slots=True)
class Rotation:
    """A committed rotation: its record, and the replicas alive (heartbeat within
    `liveness_s`) when it committed — the ones that must acknowledge it. `live` is None
    when the commit was confirmed after a lost connection."""

    record: AuditRecord
    live: frozenset[str] | None


def _live_replicas(conn: psycopg.Connection, liveness_s: float) -> frozenset[str]:
    rows = conn.execute("SELECT id FROM replicas WHERE heartbeat_at > now() - "
                        "make_interval(secs => %s)", (liveness_s,))
    return frozenset(r[0] for r in rows)


def _rotate_epoch(conn: psycopg.Connection, tenant: str) -> tuple[int, int]:
    """Compare-and-set the tenant's epoch to one more than it is; (old, new)."""
    conn.execute("INSERT INTO tenant_epochs (tenant, epoch) VALUES (%s, 0) "
                 "ON CONFLICT (tenant) DO NOTHING", (tenant,))
    row = conn.execute("SELECT epoch FROM tenant_epochs WHERE tenant = %s", (tenant,)).fetchone()
    assert row is not None
    old = row[0]
    changed = conn.execute("UPDATE tenant_epochs SET epoch = %s, changed_at = now() "
                           "WHERE tenant = %s AND epoch = %s", (old + 1, tenant, old)).rowcount
    if changed != 1:  # the audit head lock serialises rotations; this cannot happen
        raise AuditLogError(f"epoch compare-and-set for {tenant} lost ({old})")
    conn.execute("SELECT pg_notify('fak_epochs', %s)", (f"{tenant} {old + 1}",))
    return old, old + 1


class PgAuditLog:
    """Invariants (`check_integrity`): `size` never decreases; `records_written` counts the
    records this replica committed through `batches` transactions."""

    def __init__(self, dsn: str, config: AuditLogConfig, key: Ed25519PrivateKey,
                 replica: str, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.replica = replica
        self.liveness_s = 1.0  # a replica heartbeating within this may still serve
        self._dsn = dsn
        self._key = key
        self._clock = clock
        self._queue: queue.SimpleQueue[_Op] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._conn: psycopg.Connection | None = None
        self._size = 0
        self._latest: SignedCheckpoint | None = None
        self._anchor_pending: SignedCheckpoint | None = None
        self._down_since: float | None = None
        self._down_reason = ""
        self._closing = False
        self._closed = False
        self._writer: threading.Thread | None = None
        self.epochs_at_open: dict[str, int] = {}  # epochs live in tenant_epochs
        self.batches = 0
        self.records_written = 0

    @classmethod
    def open(cls, dsn: str, config: AuditLogConfig, key: Ed25519PrivateKey, replica: str,
             salt_key_check: str) -> PgAuditLog:
        """Check that this replica holds the deployment's keys (the first replica records
        them), verify the whole log, start the writer."""
        audit = cls(dsn, config, key, replica)
        conn = connect(dsn, autocommit=True)
        try:
            public = raw_public_key(key.public_key()).hex()
            with conn.transaction():
                conn.execute("INSERT INTO audit_meta (id, public_key, salt_key_check) VALUES "
                             "(1, %s, %s) ON CONFLICT (id) DO NOTHING", (public, salt_key_check))
                row = conn.execute("SELECT public_key, salt_key_check FROM audit_meta "
                                   "WHERE id = 1").fetchone()
            assert row is not None
            if row[0] != public:
                raise AuditLogError("this replica's audit signing key is not the deployment's "
                                    "(audit_meta.public_key); give every replica the same "
                                    "[audit] signing_key_path")
            if row[1] != salt_key_check:
                raise AuditLogError("this replica's salt key is not the deployment's; give "
                                    "every replica the same salt.key")
            report, checkpoints = verify_connection(conn)
            if not report.ok:
                raise AuditLogCorrupt(report)
            audit._size = report.records
            audit._latest = checkpoints[-1] if checkpoints else None
        except BaseException:
            conn.close()
            raise
        audit._conn = conn
        audit._writer = threading.Thread(target=audit._run, name="fak-audit-pg-writer",
                                         daemon=True)
        audit._writer.start()
        return audit

    # -- the file log's API ------------------------------------------------------------

    @property
    def size(self) -> int:
        return self._size

    @property
    def latest_checkpoint(self) -> SignedCheckpoint | None:
        return self._latest

    def submit(self, event: AuditEvent) -> Future[AuditRecord]:
        if not isinstance(event, AuditEvent):
            raise TypeError("append takes an AuditEvent")
        return self._enqueue(_Op("append", Future(), event=event))

    def submit_rotate(self, tenant: str,
                      event_for: Callable[[int, int], AuditEvent]) -> Future[Rotation]:
        """Compare-and-set `tenant`'s epoch and append `event_for(old, new)`, atomically.
        `event_for` is tried once here, so a bad event fails alone, not its whole batch."""
        event_for(0, 1)
        return self._enqueue(_Op("rotate", Future(), tenant=tenant, event_for=event_for))

    def submit_sql(self, sql: str, params: tuple[Any, ...]) -> Future[None]:
        """An idempotent statement, committed with the next batch (retried like appends)."""
        return self._enqueue(_Op("sql", Future(), sql=sql, params=params))

    def append(self, event: AuditEvent) -> AuditRecord:
        return self.submit(event).result()

    async def append_async(self, event: AuditEvent) -> AuditRecord:
        return await asyncio.shield(asyncio.wrap_future(self.submit(event)))

    def refusal(self) -> str | None:
        """Appends are refused only once closed; while the database is away they wait."""
        return "the audit log is closed" if self._closing or self._closed else None

    def problem(self) -> str | None:
        refusal = self.refusal()
        if refusal is not None:
            return refusal
        since = self._down_since
        if since is not None:
            return (f"the state database is unreachable for {time.monotonic() - since:.1f} s "
                    f"({self._down_reason}); audit appends wait")
        return None

    def maybe_checkpoint(self) -> SignedCheckpoint | None:
        return self._call(self._maintain_now)

    async def maintain_async(self) -> SignedCheckpoint | None:
        return await asyncio.wrap_future(self._enqueue(_Op("call", Future(),
                                                           action=self._maintain_now)))

    def checkpoint(self) -> SignedCheckpoint:
        cp = self._call(lambda conn: self._checkpoint_tx(conn, "always"))
        assert cp is not None  # forced
        return cp

    def export_checkpoint(self) -> str:
        cp = self.checkpoint()
        return canonical_json(asdict(cp)).decode()

    def close(self, timeout_s: float = 10.0) -> None:
        """Commit what is queued, waiting up to `timeout_s` for the database; what is
        still queued then was never acknowledged and is dropped (logged)."""
        with self._lock:
            first = not self._closing
            self._closing = True
            if first and self._writer is not None:
                self._queue.put(_Op("call", Future(), action=self._shutdown))
        if self._writer is not None:
            self._writer.join(timeout_s)
            if self._writer.is_alive():
                log.error("audit writer still waiting for the state database after %.0f s; "
                          "unacknowledged records queued now are not written", timeout_s)

    def check_integrity(self) -> None:
        if self.records_written and not 0 < self.batches <= self.records_written:
            raise AssertionError("more commits than records")
        if self._latest is not None and self._latest.tree_size > self._size:
            raise AssertionError("latest checkpoint covers more than the log")

    # -- the writer thread -------------------------------------------------------------

    def _enqueue(self, op: _Op) -> Future[Any]:
        with self._lock:
            if self._closing or self._closed:
                raise AuditLogError("audit log is closed")
            self._queue.put(op)
        return op.done

    def _call(self, action: Callable[[psycopg.Connection], T]) -> T:
        return self._enqueue(_Op("call", Future(), action=action)).result()

    def _run(self) -> None:
        while not self._closed:
            ops = [self._queue.get()]
            while len(ops) < self.config.max_batch:
                try:
                    ops.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            for op in ops:
                op.done = claim(op.done)
            writes = [op for op in ops if op.kind != "call"]
            if writes:
                self._commit_retrying(writes)
            for op in ops:
                if op.kind == "call":
                    self._run_call(op)

    def _connection(self) -> psycopg.Connection:
        """The writer's connection, reconnecting with backoff until the database answers."""
        backoff = Backoff()
        while self._conn is None or self._conn.closed:
            try:
                self._conn = connect(self._dsn, autocommit=True)
            except TRANSIENT as exc:
                self._went_down(exc)
                time.sleep(backoff.next())
        return self._conn

    def _went_down(self, exc: Exception) -> None:
        self._down_reason = first_line(exc)
        if self._down_since is None:
            self._down_since = time.monotonic()
            log.error("state database unreachable: %s; audit appends wait and retry",
                      self._down_reason)
        if self._conn is not None:
            self._conn.close()
        self._conn = None

    def _came_back(self) -> None:
        if self._down_since is not None:
            log.warning("state database reachable again after %.1f s",
                        time.monotonic() - self._down_since)
            self._down_since = None

    def _commit_retrying(self, ops: list[_Op]) -> None:
        backoff = Backoff()
        unsure = False
        while True:
            conn = self._connection()
            try:
                results = self._committed(conn, ops) if unsure else None
                if results is None:
                    unsure = True  # from here on the outcome of a failure is unknown
                    results = self._commit(conn, ops)
                self._came_back()
                break
            except TRANSIENT as exc:
                self._went_down(exc)
                time.sleep(backoff.next())
            except (psycopg.Error, AuditLogError, ValueError) as exc:  # a bug: never loop
                log.exception("audit batch failed")
                for op in ops:
                    op.done.set_exception(AuditLogError(f"audit write failed: {exc}"))
                return
        for op, result in zip(ops, results, strict=True):
            op.done.set_result(result)

    def _committed(self, conn: psycopg.Connection, ops: list[_Op]) -> list[Any] | None:
        """After an unknown outcome: the batch's results if it was committed, else None."""
        ids = [op.op_id for op in ops if op.kind in ("append", "rotate")]
        if not ids:
            return None  # only idempotent statements: just run them again
        rows = conn.execute("SELECT op_id, line FROM audit_entries WHERE op_id = ANY(%s)",
                            (ids,)).fetchall()
        if not rows:
            return None
        found = {op_id: _record_of(bytes(line)) for op_id, line in rows}
        return [Rotation(found[op.op_id], None) if op.kind == "rotate" else found.get(op.op_id)
                for op in ops]

    def _commit(self, conn: psycopg.Connection, ops: list[_Op]) -> list[Any]:
        with conn.transaction():
            head = lock_head(conn)
            now = int(self._clock() * 1000)
            results: list[Any] = []
            rows = []
            live = None
            for op in ops:
                if op.kind == "sql":
                    assert op.sql is not None
                    conn.execute(op.sql, op.params)  # type: ignore[arg-type]
                    results.append(None)
                    continue
                event = op.event
                if op.kind == "rotate":
                    assert op.tenant is not None and op.event_for is not None
                    event = op.event_for(*_rotate_epoch(conn, op.tenant))
                    live = live or _live_replicas(conn, self.liveness_s)
                assert event is not None
                record = AuditRecord(head.frontier.size, now, event)
                line = encode_line(head.frontier.root(), record, self._key)
                head.frontier.append(merkle.leaf_hash(line))
                rows.append((record.index, line, op.op_id, self.replica))
                results.append(Rotation(record, live) if op.kind == "rotate" else record)
            if rows:
                with conn.cursor() as cur:
                    cur.executemany("INSERT INTO audit_entries (idx, line, op_id, replica) "
                                    "VALUES (%s, %s, %s, %s)", rows)
            cp = None
            if head.frontier.size - head.cp_size >= self.config.checkpoint_every_records:
                cp = self._sign(conn, head, now)
            store_head(conn, head)
        self._size = max(self._size, head.frontier.size)
        self.batches += 1 if rows else 0
        self.records_written += len(rows)
        if cp is not None:
            self._checkpointed(cp)
        return results

    def _sign(self, conn: psycopg.Connection, head: Head, now_ms: int) -> SignedCheckpoint:
        cp = sign_checkpoint(self._key, head.frontier.size, head.frontier.root(), now_ms)
        conn.execute("INSERT INTO audit_checkpoints (tree_size, line) VALUES (%s, %s)",
                     (cp.tree_size, canonical_json(asdict(cp))))
        head.cp_size, head.cp_time_ms = cp.tree_size, now_ms
        return cp

    def _checkpointed(self, cp: SignedCheckpoint) -> None:
        self._latest = cp
        if self.config.anchor_dir is not None:
            self._anchor_pending = cp
            try:
                export_anchor(self.config.anchor_dir, cp)
                self._anchor_pending = None
            except AuditLogError as exc:
                log.warning("%s (retried by the checkpoint loop)", exc)

    def _checkpoint_tx(self, conn: psycopg.Connection, when: str) -> SignedCheckpoint | None:
        """Sign a checkpoint `when` it is "due" by time (any replica may; the head lock
        makes the others see it is done), when records are "uncovered", or "always"."""
        with conn.transaction():
            head = lock_head(conn)
            now = int(self._clock() * 1000)
            uncovered = head.frontier.size > head.cp_size
            due = {"always": True, "uncovered": uncovered,
                   "due": uncovered and now - head.cp_time_ms
                   >= self.config.checkpoint_every_seconds * 1000}[when]
            if not due:
                return None
            cp = self._sign(conn, head, now)
            store_head(conn, head)
        self._size = max(self._size, cp.tree_size)
        self._checkpointed(cp)
        return cp

    def _maintain_now(self, conn: psycopg.Connection) -> SignedCheckpoint | None:
        cp = self._checkpoint_tx(conn, "due")
        pending = self._anchor_pending
        if pending is not None and self.config.anchor_dir is not None:
            export_anchor(self.config.anchor_dir, pending)
            if self._anchor_pending is pending:
                self._anchor_pending = None
        return cp

    def _run_call(self, op: _Op) -> None:
        assert op.action is not None
        if op.action == self._shutdown:
            resolve_call(op.done, lambda: self._shutdown(self._conn))
            return
        backoff = Backoff()
        while True:
            conn = self._connection()
            try:
                op.done.set_result(op.action(conn))
                self._came_back()
                return
            except TRANSIENT as exc:
                self._went_down(exc)
                time.sleep(backoff.next())
            except BaseException as exc:
                op.done.set_exception(exc)
                return

    def _shutdown(self, conn: psycopg.Connection | None) -> None:
        """A last checkpoint over everything if the database is there; then stop."""
        try:
            if conn is not None and not conn.closed:
                with contextlib.suppress(*TRANSIENT):
                    self._checkpoint_tx(conn, "uncovered")
        finally:
            self._closed = True
            if conn is not None:
                conn.close()


def _record_of(line: bytes) -> AuditRecord:
    return AuditRecord.from_dict(json.loads(line)["record"])
