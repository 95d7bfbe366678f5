"""`fak audit verify` and `fak audit checkpoint` (wired by governor/cli.py)."""


import json
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from governor.audit.anchor import latest_anchor
from governor.audit.entry import AuditLogBusy, AuditLogError, canonical_json, checkpoints_path
from governor.audit.log import AuditLog, AuditLogConfig
from governor.audit.verify import AuditLogCorrupt, VerifyReport, read_checkpoints, verify
from schemas.audit import SignedCheckpoint


def load_anchor(path: Path | str) -> SignedCheckpoint:
    """A checkpoint file, or the latest export in an anchor directory."""
    if Path(path).is_dir():
        return latest_anchor(Path(path))
    try:
        return SignedCheckpoint.from_dict(json.loads(Path(path).read_text()))
    except (OSError, ValueError, TypeError) as exc:
        raise AuditLogError(f"cannot read anchor {path}: {exc}") from exc


def is_dsn(target: str) -> bool:
    return target.startswith(("postgresql://", "postgres://"))


def cmd_audit_verify(log: Path | str, anchor: Path | str | None = None) -> int:
    """`fak audit verify LOG|DSN [--anchor CHECKPOINT|DIR]`: a file, or the shared log in
    PostgreSQL. Exit 0 intact, 1 tampered, 2 unusable input, 3 intact but with a torn tail
    (an interrupted append; files only)."""
    try:
        trusted = None if anchor is None else load_anchor(anchor)
        if is_dsn(str(log)):
            from governor.store.pg_log import verify_database

            report = _verify_dsn(verify_database, str(log), trusted)
        elif not Path(log).is_file():
            raise AuditLogError(f"no audit log at {log}")
        else:
            report = verify(log, trusted)
    except AuditLogError as exc:
        print(f"fak audit verify: {exc}", file=sys.stderr)
        return 2
    print(report.summary())
    if not report.ok:
        return 1
    return 3 if report.torn_tail_bytes else 0


def cmd_audit_checkpoint(data_dir: Path | str, signing_key: Path | str | None = None) -> int:
    """`fak audit checkpoint`: print a signed checkpoint covering the whole log, to keep as
    an anchor. With the governor running (writer lock held), or without the signing key at
    hand, the latest stored one is printed, and stderr says how many records it does not
    cover yet."""
    config = AuditLogConfig(Path(data_dir),
                            signing_key_path=None if signing_key is None else Path(signing_key))
    if not config.log_path.is_file():
        print(f"fak audit checkpoint: no audit log at {config.log_path}", file=sys.stderr)
        return 2
    if not config.key_path.is_file():  # never create a key beside someone else's log
        return _print_stored_checkpoint(config.log_path)
    try:
        with AuditLog.open(config) as log:
            print(log.export_checkpoint())
        return 0
    except AuditLogBusy:
        return _print_stored_checkpoint(config.log_path)
    except AuditLogCorrupt as exc:
        print(exc.report.summary(), file=sys.stderr)
        return 1
    except (AuditLogError, OSError) as exc:
        print(f"fak audit checkpoint: {exc}", file=sys.stderr)
        return 2


def _verify_dsn(verify_database: Callable[[str, SignedCheckpoint | None], VerifyReport],
                dsn: str, anchor: SignedCheckpoint | None) -> VerifyReport:
    import psycopg

    try:
        return verify_database(dsn, anchor)
    except psycopg.Error as exc:
        raise AuditLogError(f"cannot read the audit log from the database: "
                            f"{str(exc).strip()}") from exc


def cmd_audit_checkpoint_dsn(dsn: str, signing_key: Path | str | None = None) -> int:
    """`fak audit checkpoint --dsn-env VAR`: with the deployment's signing key, sign and
    print a checkpoint covering the whole shared log; without it, print the latest stored
    one (stderr says how many records it does not cover)."""
    import psycopg

    from governor.store.pg_log import latest_stored_checkpoint, sign_database_checkpoint

    try:
        if signing_key is not None:
            print(canonical_json(asdict(sign_database_checkpoint(dsn, Path(signing_key))))
                  .decode())
            return 0
        latest, size = latest_stored_checkpoint(dsn)
    except (psycopg.Error, AuditLogError, OSError) as exc:
        print(f"fak audit checkpoint: {str(exc).strip()}", file=sys.stderr)
        return 2
    if latest is None:
        print("no checkpoint yet", file=sys.stderr)
        return 1
    print(canonical_json(asdict(latest)).decode())
    if latest.tree_size < size:
        print(f"note: {size - latest.tree_size} record(s) after this checkpoint; a running "
              f"governor signs the next one", file=sys.stderr)
    return 0


def _print_stored_checkpoint(log_path: Path) -> int:
    report = verify(log_path)
    checkpoints, _ = read_checkpoints(checkpoints_path(log_path))
    if not report.ok or not checkpoints:
        print(report.summary() if not report.ok else "no checkpoint yet", file=sys.stderr)
        return 1
    latest = checkpoints[-1]
    print(canonical_json(asdict(latest)).decode())
    if latest.tree_size < report.records:
        print(f"note: {report.records - latest.tree_size} record(s) after this checkpoint; "
              f"the running governor signs the next one", file=sys.stderr)
    return 0
