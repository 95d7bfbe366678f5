"""Build the shared state of a `postgres` deployment at start-up: migrations, the audit log,
the epoch watcher and the quarantine records (the `file` backend stays in governor.serve)."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import socket
import time
from dataclasses import dataclass

from governor.audit.log import AuditLogConfig, load_or_create_signing_key
from governor.config import GovernorConfig
from governor.secrets import StartupRefused
from governor.store.connect import TRANSIENT, connect, dsn_from_env, first_line
from governor.store.migrations import migrate
from governor.store.pg_audit import PgAuditLog
from governor.store.pg_epochs import PgEpochs
from governor.store.records import PgRecords
from governor.store.watcher import EpochWatcher
from policies.salts import SaltKey, frame

log = logging.getLogger("fak.store")
STARTUP_WAIT_S = 15.0
SALT_CHECK_DOMAIN = b"fak-salt-key-check-v1"


@dataclass
class SharedState:
    audit: PgAuditLog
    epochs: PgEpochs
    records: PgRecords


def default_replica_id() -> str:
    name = re.sub(r"[^a-z0-9_.-]+", "-", socket.gethostname().lower()).strip("-.") or "host"
    return f"{name[:48]}-{os.getpid()}"


def salt_key_check(key: SaltKey) -> str:
    """A keyed value replicas compare to find a different salt key (reveals nothing)."""
    return hmac.new(key.secret, frame(SALT_CHECK_DOMAIN), hashlib.sha256).hexdigest()


def open_shared_state(config: GovernorConfig, audit_config: AuditLogConfig,
                      salt_key: SaltKey) -> SharedState:
    """Connect (waiting up to STARTUP_WAIT_S), migrate, open the log, confirm the epochs.
    Anything missing refuses the start, with the reason."""
    state = config.state
    dsn = dsn_from_env(state.dsn_env)
    applied = _migrate_when_up(dsn)
    if applied:
        log.warning("state database migrated to schema version %d", applied[-1])
    replica = state.replica_id or default_replica_id()
    key = load_or_create_signing_key(audit_config.key_path)
    audit = PgAuditLog.open(dsn, audit_config, key, replica, salt_key_check(salt_key))
    audit.liveness_s = state.epoch_max_staleness_ms / 1000
    watcher = EpochWatcher(dsn, replica, socket.gethostname(), os.getpid(),
                           state.epoch_max_staleness_ms / 1000)
    if not watcher.start(STARTUP_WAIT_S):
        audit.close()
        watcher.stop(deregister=False)
        raise StartupRefused("could not confirm tenant epochs with the state database")
    return SharedState(audit, PgEpochs(audit, watcher), PgRecords(audit, dsn))


def _migrate_when_up(dsn: str) -> list[int]:
    deadline = time.monotonic() + STARTUP_WAIT_S
    while True:
        try:
            with connect(dsn, autocommit=True) as conn:
                return migrate(conn)
        except TRANSIENT as exc:
            if time.monotonic() >= deadline:
                raise StartupRefused(f"the state database is unreachable: "
                                     f"{first_line(exc)}") from exc
            time.sleep(0.5)
