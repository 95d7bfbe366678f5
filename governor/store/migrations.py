"""The state database's schema, applied by the governor at start-up.

Each migration runs once, in order, inside one transaction holding an advisory lock, so
replicas starting together never race; `fak_schema_migrations` lists what was applied. A
database whose schema is newer than this governor knows is refused.

Tables: `tenant_epochs` (changed only by compare-and-set), `audit_meta` (the deployment's
audit public key and a keyed check value of its salt key), `audit_head` (the one row every
append locks: size, Merkle frontier, last checkpoint), `audit_entries` (the log, one row per
index, append-only by trigger; `op_id` makes a retried append idempotent),
`audit_checkpoints`, `replicas` (registry and heartbeats), `replica_epochs` (each
replica's acknowledged epoch per tenant), `quarantine_records`.
"""

from __future__ import annotations

import psycopg

LOCK_KEY = 0x66616B5F7374  # "fak_st": the advisory lock migrations run under

MIGRATIONS: tuple[tuple[int, str], ...] = (
    (1, """
CREATE TABLE tenant_epochs (
    tenant text PRIMARY KEY,
    epoch bigint NOT NULL CHECK (epoch >= 0),
    changed_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE audit_meta (
    id int PRIMARY KEY CHECK (id = 1),
    public_key text NOT NULL CHECK (public_key ~ '^[0-9a-f]{64}$'),
    salt_key_check text NOT NULL CHECK (salt_key_check ~ '^[0-9a-f]{64}$')
);
CREATE TABLE audit_head (
    id int PRIMARY KEY CHECK (id = 1),
    size bigint NOT NULL CHECK (size >= 0),
    frontier text[] NOT NULL,
    cp_size bigint NOT NULL,
    cp_time_ms bigint NOT NULL
);
INSERT INTO audit_head VALUES (1, 0, '{}', 0, 0);
CREATE TABLE audit_entries (
    idx bigint PRIMARY KEY CHECK (idx >= 0),
    line bytea NOT NULL,
    op_id uuid NOT NULL UNIQUE,
    replica text NOT NULL
);
CREATE TABLE audit_checkpoints (
    seq bigserial PRIMARY KEY,
    tree_size bigint NOT NULL,
    line bytea NOT NULL
);
CREATE FUNCTION fak_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'fak audit tables are append-only (% on %)', TG_OP, TG_TABLE_NAME;
END $$;
CREATE TRIGGER audit_entries_append_only BEFORE UPDATE OR DELETE OR TRUNCATE
    ON audit_entries FOR EACH STATEMENT EXECUTE FUNCTION fak_append_only();
CREATE TRIGGER audit_checkpoints_append_only BEFORE UPDATE OR DELETE OR TRUNCATE
    ON audit_checkpoints FOR EACH STATEMENT EXECUTE FUNCTION fak_append_only();
CREATE TABLE replicas (
    id text PRIMARY KEY,
    host text NOT NULL,
    pid int NOT NULL,
    started_at timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE replica_epochs (
    replica text NOT NULL,
    tenant text NOT NULL,
    epoch bigint NOT NULL,
    acked_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (replica, tenant)
);
CREATE TABLE quarantine_records (
    id text PRIMARY KEY,
    tenant text NOT NULL,
    audit_index bigint NOT NULL,
    doc jsonb NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
"""),
)


class SchemaTooNew(RuntimeError):
    """The database was migrated by a newer governor."""


def migrate(conn: psycopg.Connection) -> list[int]:
    """Apply what is missing; the versions applied now (empty when up to date)."""
    applied_now = []
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK_KEY,))
        conn.execute("CREATE TABLE IF NOT EXISTS fak_schema_migrations ("
                     "version int PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())")
        done = {row[0] for row in conn.execute("SELECT version FROM fak_schema_migrations")}
        known = {version for version, _ in MIGRATIONS}
        if done - known:
            raise SchemaTooNew(f"the state database has schema versions {sorted(done - known)} "
                               f"this governor does not know; upgrade the governor")
        for version, sql in MIGRATIONS:
            if version not in done:
                conn.execute(sql)  # type: ignore[arg-type]
                conn.execute("INSERT INTO fak_schema_migrations (version) VALUES (%s)",
                             (version,))
                applied_now.append(version)
    return applied_now
