"""Quarantine records in the state database, so `GET /admin/v1/quarantine/{id}` answers on
every replica. Written through the audit writer (retried like an append, idempotent by
id); read on a connection of their own, off the event loop."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from governor.store.connect import TRANSIENT, connect, first_line
from governor.store.pg_audit import PgAuditLog
from schemas.engine import EngineError

INSERT = ("INSERT INTO quarantine_records (id, tenant, audit_index, doc) VALUES "
          "(%s, %s, %s, %s) ON CONFLICT (id) DO NOTHING")


class PgRecords:
    def __init__(self, audit: PgAuditLog, dsn: str) -> None:
        self._audit = audit
        self._dsn = dsn
        self._conn: psycopg.Connection | None = None
        self._lock = threading.Lock()

    async def put(self, quarantine_id: str, tenant: str, audit_index: int,
                  doc: dict[str, Any]) -> None:
        """Durable once this returns (committed with the writer's next batch)."""
        await asyncio.wrap_future(self._audit.submit_sql(
            INSERT, (quarantine_id, tenant, audit_index, Jsonb(doc))))

    async def get(self, quarantine_id: str) -> dict[str, Any] | None:
        return await asyncio.to_thread(self._get, quarantine_id)

    def _get(self, quarantine_id: str) -> dict[str, Any] | None:
        with self._lock:
            for attempt in (1, 2):  # one reconnect: the connection may be from before a restart
                try:
                    if self._conn is None or self._conn.closed:
                        self._conn = connect(self._dsn, autocommit=True)
                    row = self._conn.execute("SELECT doc FROM quarantine_records WHERE id = %s",
                                             (quarantine_id,)).fetchone()
                    return None if row is None else dict(row[0])
                except TRANSIENT as exc:
                    self._conn = None
                    if attempt == 2:
                        raise EngineError(503, f"the state database is unreachable: "
                                               f"{first_line(exc)}",
                                          type="server_error") from None
        return None

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
