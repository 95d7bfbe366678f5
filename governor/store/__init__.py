"""Shared governor state on PostgreSQL (`[state] backend = "postgres"`): tenant epochs,
quarantine records, one audit log for the deployment and a replica registry.

- `connect`:    the DSN from the environment, connections with timeouts, backoff.
- `migrations`: the schema, applied by the governor itself at start-up.
- `pg_log`:     the log tables: head row, verification by DSN, checkpoints signed from outside.
- `pg_audit`:   the shared audit log (same entries, tree, signatures, checkpoints as the file
                log) written by a group-commit thread inside transactions.
- `watcher`:    LISTEN/NOTIFY for epochs, the confirmation poll, heartbeats and acks.
- `pg_epochs`:  epochs by compare-and-set with bounded staleness (fail closed past it).
- `records`:    quarantine records readable from every replica.
- `backend`:    builds the governor's state for either backend.
"""
