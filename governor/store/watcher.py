"""What a replica knows about the shared epochs, kept fresh by one thread: LISTEN/NOTIFY for
changes, a confirmation poll, the replica's heartbeat and its acknowledgements.

The thread holds one autocommit connection that LISTENs on `fak_epochs` (a rotation's
`tenant epoch`) and `fak_acks` (`replica tenant epoch`); a notification only says which
tenant to re-read from the tables (anyone with a login may NOTIFY). Every `poll_s` (a quarter of the
staleness bound) it runs one round of: heartbeat (upsert into `replicas`), read every tenant's
epoch, read the live replicas and their acknowledged epochs. `confirmed_at` is the monotonic
time that round was *sent*: the epochs it read are at least that fresh, so a replica that
serves only while `now - confirmed_at <= bound` never uses an epoch older than the bound
(notifications only make it faster). Epochs only grow here. Each epoch the replica starts
using is acknowledged in `replica_epochs` (and NOTIFYed), which is what a rotating replica
waits for.

A lost connection is retried with backoff; meanwhile `confirmed_at` ages and the replica
fails closed (`PgEpochs.get` answers 503) once the bound passes.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterable

import psycopg

from governor.store.connect import TRANSIENT, Backoff, connect, first_line

log = logging.getLogger("fak.store.epochs")

HEARTBEAT = ("INSERT INTO replicas (id, host, pid) VALUES (%s, %s, %s) ON CONFLICT (id) DO "
             "UPDATE SET heartbeat_at = now(), host = excluded.host, pid = excluded.pid")
LIVE = ("SELECT r.id, e.tenant, e.epoch FROM replicas r LEFT JOIN replica_epochs e "
        "ON e.replica = r.id WHERE r.heartbeat_at > now() - make_interval(secs => %s)")
ACK = ("WITH acked AS (INSERT INTO replica_epochs (replica, tenant, epoch) "
       "SELECT %s, t, e FROM unnest(%s::text[], %s::bigint[]) AS u(t, e) "
       "ON CONFLICT (replica, tenant) DO UPDATE SET "
       "epoch = GREATEST(replica_epochs.epoch, excluded.epoch), acked_at = now() "
       "RETURNING tenant, epoch) "
       "SELECT pg_notify('fak_acks', %s || ' ' || tenant || ' ' || epoch) FROM acked")


class EpochWatcher:
    """Invariants (`check_integrity`): epochs and acks are ≥ 0; every acknowledged epoch
    of this replica is one it holds."""

    def __init__(self, dsn: str, replica: str, host: str, pid: int, bound_s: float) -> None:
        self.replica, self.bound_s = replica, bound_s
        self.poll_s = bound_s / 4
        self._dsn, self._host, self._pid = dsn, host, pid
        self._lock = threading.Lock()
        self._epochs: dict[str, int] = {}
        self._acked: dict[str, int] = {}  # what this replica has acknowledged
        self._acks: dict[tuple[str, str], int] = {}  # (replica, tenant) → epoch, all replicas
        self._live: frozenset[str] = frozenset()
        self.confirmed_at = -math.inf
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fak-epoch-watcher",
                                        daemon=True)
        self.polls = 0

    # -- read by the event loop --------------------------------------------------------

    def epoch(self, tenant: str) -> int:
        return self._epochs.get(tenant, 0)

    def age_s(self) -> float:
        return time.monotonic() - self.confirmed_at

    def live_replicas(self) -> frozenset[str]:
        return self._live | {self.replica}

    def acked(self, replica: str, tenant: str) -> int:
        return self._acks.get((replica, tenant), -1)

    def apply(self, tenant: str, epoch: int) -> None:
        """Start using `epoch` for `tenant` (if newer); it is acknowledged on the next round."""
        with self._lock:
            if epoch > self._epochs.get(tenant, 0):
                self._epochs[tenant] = epoch
            if epoch > self._acks.get((self.replica, tenant), -1):
                self._acks[(self.replica, tenant)] = epoch

    # -- lifecycle ---------------------------------------------------------------------

    def start(self, timeout_s: float) -> bool:
        """Start the thread; True once the first round confirmed the epochs."""
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.polls == 0:
            time.sleep(0.01)
        return self.polls > 0

    def stop(self, deregister: bool = True) -> None:
        self._stop.set()
        self._thread.join(5)
        if deregister:
            try:
                with connect(self._dsn, autocommit=True) as conn:
                    conn.execute("DELETE FROM replica_epochs WHERE replica = %s", (self.replica,))
                    conn.execute("DELETE FROM replicas WHERE id = %s", (self.replica,))
            except TRANSIENT as exc:
                log.warning("replica %s not deregistered: %s", self.replica, exc)

    def check_integrity(self) -> None:
        with self._lock:
            assert all(e >= 0 for e in self._epochs.values())
            for tenant, epoch in self._acked.items():
                assert epoch <= self._epochs.get(tenant, 0), (tenant, epoch)

    # -- the thread --------------------------------------------------------------------

    def _run(self) -> None:
        backoff, conn, down_since = Backoff(), None, None
        while not self._stop.is_set():
            try:
                if conn is None:
                    conn = connect(self._dsn, autocommit=True)
                    conn.execute("LISTEN fak_epochs")
                    conn.execute("LISTEN fak_acks")
                self._round(conn)
                self._listen(conn, time.monotonic() + self.poll_s)
                if down_since is not None:
                    log.warning("epochs confirmed again after %.1f s",
                                time.monotonic() - down_since)
                    down_since = None
                backoff.reset()
            except TRANSIENT as exc:
                if down_since is None:
                    down_since = time.monotonic()
                    log.error("cannot confirm tenant epochs: %s; requests fail closed after "
                              "%.0f ms", first_line(exc), self.bound_s * 1000)
                if conn is not None:
                    conn.close()
                conn = None
                self._stop.wait(backoff.next())
        if conn is not None:
            conn.close()

    def _round(self, conn: psycopg.Connection) -> None:
        sent = time.monotonic()
        conn.execute(HEARTBEAT, (self.replica, self._host, self._pid))
        epochs = conn.execute("SELECT tenant, epoch FROM tenant_epochs").fetchall()
        live = conn.execute(LIVE, (self.bound_s,)).fetchall()
        for tenant, epoch in epochs:
            self.apply(tenant, epoch)
        with self._lock:
            self._live = frozenset(r for r, _, _ in live)
            for replica, tenant, epoch in live:
                if tenant is not None and epoch > self._acks.get((replica, tenant), -1):
                    self._acks[(replica, tenant)] = epoch
        self._acknowledge(conn)
        self.confirmed_at = sent
        self.polls += 1

    def _listen(self, conn: psycopg.Connection, until: float) -> None:
        """Take notifications until the next round is due; after each burst, read what they
        name from the tables and acknowledge."""
        while not self._stop.is_set() and (wait := until - time.monotonic()) > 0:
            burst = list(conn.notifies(timeout=wait, stop_after=1))
            if not burst:
                return
            burst += conn.notifies(timeout=0.002)  # the rest of a group commit's batch
            self._refresh(conn, [(n.channel, n.payload) for n in burst])
            self._acknowledge(conn)

    def _refresh(self, conn: psycopg.Connection, notes: Iterable[tuple[str, str]]) -> None:
        """A notification is only a wake-up (any database user may NOTIFY): the epochs and
        acknowledgements it names are read from their tables, never from its payload."""
        epochs, acks = set(), set()
        for channel, payload in notes:
            parts = payload.split(" ")
            if channel == "fak_epochs" and parts:
                epochs.add(parts[0])
            elif channel == "fak_acks" and len(parts) == 3:
                acks.add(parts[1])
        if epochs:
            for tenant, epoch in conn.execute("SELECT tenant, epoch FROM tenant_epochs WHERE "
                                              "tenant = ANY(%s)", (sorted(epochs),)):
                self.apply(tenant, epoch)
        if acks:
            rows = conn.execute("SELECT replica, tenant, epoch FROM replica_epochs WHERE "
                                "tenant = ANY(%s)", (sorted(acks),)).fetchall()
            with self._lock:
                for replica, tenant, epoch in rows:
                    if epoch > self._acks.get((replica, tenant), -1):
                        self._acks[(replica, tenant)] = epoch

    def _acknowledge(self, conn: psycopg.Connection) -> None:
        with self._lock:
            due = {t: e for t, e in self._epochs.items() if e > self._acked.get(t, -1)}
        if not due:
            return
        tenants, epochs = list(due), [due[t] for t in due]
        conn.execute(ACK, (self.replica, tenants, epochs, self.replica))
        with self._lock:
            self._acked.update(due)
