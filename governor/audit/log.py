"""The audit log's writer: tamper-evident and append-only (docs/security.md §7, SEC-12/13/14/18).

Files, all beside each other (default `<data_dir>/`):

- `audit.log`          one entry per line: canonical JSON (sorted keys, compact, UTF-8)
                       `{"prev": <hex MTH of all earlier entries>, "record": <AuditRecord>,
                       "sig": <hex Ed25519 over prev+record>}` and a newline.
- `audit.checkpoints`  signed checkpoints (tree heads), one canonical JSON line each, written
                       every N records, every T seconds (checked on append and by
                       `maybe_checkpoint`) and at close.
- `audit.pub`          the hex Ed25519 public key; `audit_signing.key` the private key
                       (PEM, mode 0600, created if absent; put it elsewhere with
                       `signing_key_path`).

Entries are described in governor.audit.entry, verification in governor.audit.verify.

Writer policy: `AuditLog.open` verifies the whole log with its own key first and refuses to
write to a log that fails (`AuditLogCorrupt`) — appending to a forged history would bless
it. A torn tail is moved to `audit.log.torn-<offset>` and the recovery is itself recorded.
An append that fails leaves the log refusing further appends until reopened, so the
governor fails closed (SEC-18). One writer at a time (an exclusive `flock`).
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from governor.audit import merkle
from governor.audit.entry import (
    KEY_NAME,
    LOG_NAME,
    AuditLogBusy,
    AuditLogError,
    canonical_json,
    checkpoints_path,
    encode_line,
    public_key_path,
    raw_public_key,
    sign_checkpoint,
)
from governor.audit.verify import AuditLogCorrupt, verify_with_scan
from schemas.audit import AuditEvent, AuditRecord, AuditState, SignedCheckpoint


@dataclass(frozen=True, slots=True)
class AuditLogConfig:
    """`checkpoint_every_records` / `checkpoint_every_seconds`: sign a checkpoint once either
    is reached (and at close). `fsync` off only for throwaway logs."""

    data_dir: Path
    checkpoint_every_records: int = 64
    checkpoint_every_seconds: float = 60.0
    signing_key_path: Path | None = None
    fsync: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.data_dir, Path):
            raise TypeError("data_dir must be a Path")
        if self.checkpoint_every_records < 1:
            raise ValueError("checkpoint_every_records must be ≥ 1")
        if not self.checkpoint_every_seconds > 0:
            raise ValueError("checkpoint_every_seconds must be > 0")

    @property
    def log_path(self) -> Path:
        return self.data_dir / LOG_NAME

    @property
    def key_path(self) -> Path:
        return self.signing_key_path or self.data_dir / KEY_NAME


def load_or_create_signing_key(path: Path) -> Ed25519PrivateKey:
    """Load the Ed25519 key at `path`, or create it with mode 0600. A key others can read
    is refused."""
    if path.exists():
        mode = path.stat().st_mode & 0o777
        if mode & 0o077:
            raise AuditLogError(f"signing key {path} has mode {mode:o}; it must be 0600")
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise AuditLogError(f"signing key {path} is not an Ed25519 key")
        return key
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        write_all(fd, pem, sync=True)
    finally:
        os.close(fd)
    return key


def write_all(fd: int, data: bytes, sync: bool) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    if sync:
        os.fsync(fd)


class AuditLog:
    """The single writer. Invariants (`check_integrity`): the in-memory leaves are exactly
    the file's lines; the frontier root is their MTH; the last checkpoint is within size."""

    def __init__(self, config: AuditLogConfig, clock: Callable[[], float],
                 key: Ed25519PrivateKey, log_fd: int, cp_fd: int) -> None:
        self.config = config
        self._clock = clock
        self._key = key
        self._log_fd = log_fd
        self._cp_fd = cp_fd
        self._lock = threading.Lock()
        self._leaf_hashes: list[bytes] = []
        self._frontier = merkle.Frontier()
        self._log_bytes = 0
        self._latest: SignedCheckpoint | None = None
        self._last_checkpoint_at = clock()
        self._broken: str | None = None
        self._closed = False

    @classmethod
    def open(cls, config: AuditLogConfig,
             clock: Callable[[], float] = time.time) -> AuditLog:
        """Open (creating if needed), take the writer lock, repair a torn tail, verify."""
        config.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        key = load_or_create_signing_key(config.key_path)
        _publish_public_key(public_key_path(config.log_path), key)
        log_fd = os.open(config.log_path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            fcntl.flock(log_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            os.close(log_fd)
            raise AuditLogBusy(f"{config.log_path} is held by another writer") from exc
        cp_fd = os.open(checkpoints_path(config.log_path),
                        os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        log = cls(config, clock, key, log_fd, cp_fd)
        try:
            log._load()
        except BaseException:
            log._release()
            raise
        return log

    def _load(self) -> None:
        repairs = self._repair_torn_tails()
        report, scan, checkpoints = verify_with_scan(self.config.log_path, None,
                                            raw_public_key(self._key.public_key()).hex())
        if not report.ok:
            raise AuditLogCorrupt(report)
        self._leaf_hashes, self._frontier = scan.leaf_hashes, scan.frontier
        self._log_bytes = os.fstat(self._log_fd).st_size
        self._latest = checkpoints[-1] if checkpoints else None
        if repairs:
            self.append(AuditEvent(kind="log_recovered", actor="governor",
                                   state=AuditState.RECORDED, reasons=tuple(repairs)))

    def _repair_torn_tails(self) -> list[str]:
        """Move an unterminated last line aside (kept as evidence) and cut it off."""
        reasons = []
        for fd, path, label in ((self._log_fd, self.config.log_path, "log"),
                                (self._cp_fd, checkpoints_path(self.config.log_path),
                                 "checkpoints")):
            data = path.read_bytes()
            end = data.rfind(b"\n") + 1
            if end == len(data):
                continue
            aside = path.with_name(f"{path.name}.torn-{end}")
            aside.write_bytes(data[end:])
            aside.chmod(0o600)
            os.ftruncate(fd, end)
            os.fsync(fd)
            reasons.append(f"torn_{label}_tail_bytes={len(data) - end}")
            reasons.append(f"moved_to={aside.name.lower()}")
        return reasons

    # -- public API --------------------------------------------------------------------

    @property
    def size(self) -> int:
        return self._frontier.size

    @property
    def latest_checkpoint(self) -> SignedCheckpoint | None:
        return self._latest

    def root_hash(self) -> str:
        return self._frontier.root().hex()

    def append(self, event: AuditEvent) -> AuditRecord:
        """Commit one record (fsync'd) and return it; raises AuditLogError if it cannot."""
        if not isinstance(event, AuditEvent):
            raise TypeError("append takes an AuditEvent")
        with self._lock:
            self._ensure_writable()
            record = AuditRecord(self.size, self._now_ms(), event)
            line = encode_line(self._frontier.root(), record, self._key)
            self._write(self._log_fd, line + b"\n")
            self._log_bytes += len(line) + 1
            leaf = merkle.leaf_hash(line)
            self._leaf_hashes.append(leaf)
            self._frontier.append(leaf)
            if self._checkpoint_due():
                self._checkpoint_locked()
            return record

    def maybe_checkpoint(self) -> SignedCheckpoint | None:
        """Sign a checkpoint if one is due (call from a timer for the T-seconds rule)."""
        with self._lock:
            self._ensure_writable()
            return self._checkpoint_locked() if self._checkpoint_due() else None

    def checkpoint(self) -> SignedCheckpoint:
        with self._lock:
            self._ensure_writable()
            return self._checkpoint_locked()

    def export_checkpoint(self) -> str:
        """The latest signed checkpoint covering every record, as canonical JSON (an anchor
        to copy to a store the log host cannot write)."""
        with self._lock:
            self._ensure_writable()
            latest = self._latest
            if latest is None or latest.tree_size != self.size:
                latest = self._checkpoint_locked()
            return canonical_json(asdict(latest)).decode()

    def inclusion_proof(self, index: int, tree_size: int | None = None) -> list[str]:
        size = self.size if tree_size is None else tree_size
        self._check_size(size)
        return [h.hex() for h in merkle.inclusion_proof(self._leaf_hashes[:size], index)]

    def consistency_proof(self, old_size: int, new_size: int | None = None) -> list[str]:
        size = self.size if new_size is None else new_size
        self._check_size(size)
        return [h.hex() for h in merkle.consistency_proof(self._leaf_hashes[:size], old_size)]

    def close(self) -> None:
        """Checkpoint anything uncovered, then release the lock. Idempotent."""
        with self._lock:
            if self._closed:
                return
            try:
                if self._broken is None and (self._latest is None
                                             or self._latest.tree_size != self.size):
                    self._checkpoint_locked()
            finally:
                self._release()

    def check_integrity(self) -> None:
        with self._lock:
            self._frontier.check_integrity()
            if len(self._leaf_hashes) != self._frontier.size:
                raise AssertionError("leaf list and frontier disagree on size")
            if merkle.root(self._leaf_hashes) != self._frontier.root():
                raise AssertionError("frontier root is not the MTH of the leaves")
            if not self._closed and os.fstat(self._log_fd).st_size != self._log_bytes:
                raise AssertionError("log file length changed behind the writer")
            if self._latest is not None and self._latest.tree_size > self.size:
                raise AssertionError("latest checkpoint covers more than the log")

    def __enter__(self) -> AuditLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    def _check_size(self, size: int) -> None:
        if not 0 <= size <= self.size:
            raise ValueError(f"tree size {size} outside 0..{self.size}")

    def _ensure_writable(self) -> None:
        if self._closed:
            raise AuditLogError("audit log is closed")
        if self._broken is not None:
            raise AuditLogError(f"audit log refuses appends after a failed write: "
                                f"{self._broken}; reopen it")

    def _write(self, fd: int, data: bytes) -> None:
        try:
            write_all(fd, data, sync=self.config.fsync)
        except OSError as exc:
            self._broken = str(exc)
            raise AuditLogError(f"audit write failed: {exc}") from exc

    def _checkpoint_due(self) -> bool:
        covered = 0 if self._latest is None else self._latest.tree_size
        pending = self.size - covered
        waited = self._clock() - self._last_checkpoint_at
        return pending >= self.config.checkpoint_every_records or (
            pending > 0 and waited >= self.config.checkpoint_every_seconds)

    def _checkpoint_locked(self) -> SignedCheckpoint:
        cp = sign_checkpoint(self._key, self.size, self._frontier.root(), self._now_ms())
        self._write(self._cp_fd, canonical_json(asdict(cp)) + b"\n")
        self._latest = cp
        self._last_checkpoint_at = self._clock()
        return cp

    def _release(self) -> None:
        self._closed = True
        for fd in (self._cp_fd, self._log_fd):
            os.close(fd)


def _publish_public_key(path: Path, key: Ed25519PrivateKey) -> None:
    public = raw_public_key(key.public_key()).hex()
    if path.exists():
        if path.read_text().strip() != public:
            raise AuditLogError(f"{path} does not match the signing key")
        return
    path.write_text(public + "\n")


