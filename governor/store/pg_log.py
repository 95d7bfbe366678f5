"""The shared audit log's tables as a log: its head row, verification by DSN (what
`fak audit verify` and `PgAuditLog.open` run), and checkpoints signed from outside a
governor (`fak audit checkpoint --dsn-env`)."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psycopg

from governor.audit import merkle
from governor.audit.entry import AuditLogError, canonical_json, raw_public_key, sign_checkpoint
from governor.audit.log import load_or_create_signing_key
from governor.audit.verify import VerifyReport, _trusted_key, parse_checkpoints, verify_data
from governor.store.connect import connect
from schemas.audit import SignedCheckpoint


@dataclass(slots=True)
class Head:
    """The `audit_head` row: the log's size and frontier, and its last checkpoint."""

    size: int
    frontier: merkle.Frontier
    cp_size: int
    cp_time_ms: int


def lock_head(conn: psycopg.Connection) -> Head:
    row = conn.execute("SELECT size, frontier, cp_size, cp_time_ms FROM audit_head "
                       "WHERE id = 1 FOR UPDATE").fetchone()
    assert row is not None, "audit_head row missing (migrations not applied)"
    return Head(row[0], merkle.Frontier.from_hex(row[0], row[1]), row[2], row[3])


def store_head(conn: psycopg.Connection, head: Head) -> None:
    conn.execute("UPDATE audit_head SET size = %s, frontier = %s, cp_size = %s, "
                 "cp_time_ms = %s WHERE id = 1",
                 (head.frontier.size, head.frontier.to_hex(), head.cp_size, head.cp_time_ms))


def verify_connection(conn: psycopg.Connection, anchor: SignedCheckpoint | None = None,
                      public_key: str | None = None
                      ) -> tuple[VerifyReport, list[SignedCheckpoint]]:
    """Verify the database's log as `fak audit verify` does a file: every entry in index
    order (a missing index is named), its checkpoints, against `audit_meta`'s key or the
    anchor's. Also checks that the head agrees with the entries."""
    with conn.transaction():
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
        meta = conn.execute("SELECT public_key FROM audit_meta WHERE id = 1").fetchone()
        lines = [bytes(r[0]) for r in conn.execute("SELECT line FROM audit_entries ORDER BY idx")]
        cp_lines = [bytes(r[0]) for r in conn.execute(
            "SELECT line FROM audit_checkpoints ORDER BY seq")]
        head = conn.execute("SELECT size, frontier FROM audit_head WHERE id = 1").fetchone()
    key, problems = _trusted_key(None if meta is None else meta[0], "audit_meta", anchor,
                                 public_key)
    checkpoints, cp_problems = parse_checkpoints(cp_lines)
    data = b"".join(line + b"\n" for line in lines)
    report, scan, _ = verify_data(data, checkpoints, key, anchor, problems + cp_problems)
    if head is not None and report.ok and (
            head[0] != scan.frontier.size or head[1] != scan.frontier.to_hex()):
        report = _with_problem(report, f"audit_head says {head[0]} records with another "
                                       f"frontier; the entries hold {scan.frontier.size}")
    return report, checkpoints


def _with_problem(report: VerifyReport, problem: str) -> VerifyReport:
    fields = asdict(report)
    fields.update(ok=False, problems=(*report.problems, problem))
    return VerifyReport(**fields)


def verify_database(dsn: str, anchor: SignedCheckpoint | None = None) -> VerifyReport:
    with connect(dsn, autocommit=True) as conn:
        return verify_connection(conn, anchor)[0]


def latest_stored_checkpoint(dsn: str) -> tuple[SignedCheckpoint | None, int]:
    """The newest checkpoint in the database and the log's size."""
    with connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT line FROM audit_checkpoints ORDER BY seq DESC "
                           "LIMIT 1").fetchone()
        size = conn.execute("SELECT size FROM audit_head WHERE id = 1").fetchone()
    cp = None if row is None else SignedCheckpoint.from_dict(json.loads(bytes(row[0])))
    return cp, 0 if size is None else size[0]


def sign_database_checkpoint(dsn: str, key_path: Path) -> SignedCheckpoint:
    """Sign a checkpoint of the whole shared log now (the key must be the deployment's)."""
    key = load_or_create_signing_key(key_path) if key_path.is_file() else None
    if key is None:
        raise AuditLogError(f"no signing key at {key_path}")
    with connect(dsn, autocommit=True) as conn:
        meta = conn.execute("SELECT public_key FROM audit_meta WHERE id = 1").fetchone()
        if meta is None or meta[0] != raw_public_key(key.public_key()).hex():
            raise AuditLogError(f"{key_path} is not the deployment's audit signing key")
        with conn.transaction():
            head = lock_head(conn)
            cp = sign_checkpoint(key, head.frontier.size, head.frontier.root(),
                                 int(time.time() * 1000))
            conn.execute("INSERT INTO audit_checkpoints (tree_size, line) VALUES (%s, %s)",
                         (cp.tree_size, canonical_json(asdict(cp))))
            head.cp_size, head.cp_time_ms = cp.tree_size, cp.timestamp_ms
            store_head(conn, head)
    return cp

