"""The audit log's writer: tamper-evident and append-only (docs/security.md §7, SEC-12/13/14/18).

Files, all beside each other (default `<data_dir>/`):

- `audit.log`          one entry per line: canonical JSON (sorted keys, compact, UTF-8)
                       `{"prev": <hex MTH of all earlier entries>, "record": <AuditRecord>,
                       "sig": <hex Ed25519 over prev+record>}` and a newline.
- `audit.checkpoints`  signed checkpoints (tree heads), one canonical JSON line each, written
                       every N records, every T seconds (checked after each commit and by
                       `maybe_checkpoint`) and at close; each is also exported to
                       `anchor_dir` when one is configured (governor.audit.anchor).
- `audit.pub`          the hex Ed25519 public key; `audit_signing.key` the private key
                       (PEM, mode 0600, created if absent; put it elsewhere with
                       `signing_key_path`).

Entries are described in governor.audit.entry, verification in governor.audit.verify.

Writer policy: `AuditLog.open` verifies the whole log with its own key first and refuses to
write to a log that fails (`AuditLogCorrupt`) — appending to a forged history would bless
it. A torn tail is moved to `audit.log.torn-<offset>` and the recovery is itself recorded.
One writer at a time (an exclusive `flock`).

Group commit: every append goes to one writer thread, which takes all pending appends,
writes them with one `write` and one `fsync`, and only then answers each caller with its
record — so nothing acknowledged is lost, and no caller's thread (the event loop above all)
ever fsyncs. A failed write cuts the file back to its last committed length, answers every
append of the batch with `AuditLogError`, and leaves the log refusing further appends until
reopened, so the governor fails closed (SEC-18) and the log never holds a record whose
caller was told it failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from governor.audit import merkle
from governor.audit.anchor import AnchorExportError, export_anchor
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

log = logging.getLogger("fak.audit")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class AuditLogConfig:
    """`checkpoint_every_records` / `checkpoint_every_seconds`: sign a checkpoint once either
    is reached (and at close). `anchor_dir`: where every checkpoint is also exported.
    `min_free_bytes`: below this much free space the log reports itself not ready.
    `max_batch`: appends committed by one write. `fsync` off only for throwaway logs."""

    data_dir: Path
    checkpoint_every_records: int = 64
    checkpoint_every_seconds: float = 60.0
    signing_key_path: Path | None = None
    anchor_dir: Path | None = None
    min_free_bytes: int = 1 << 20
    max_batch: int = 1024
    fsync: bool = True

    def __post_init__(self) -> None:
        for name in ("data_dir", "signing_key_path", "anchor_dir"):
            value = getattr(self, name)
            if not isinstance(value, Path) and (value is not None or name == "data_dir"):
                raise TypeError(f"{name} must be a Path")
        if self.checkpoint_every_records < 1:
            raise ValueError("checkpoint_every_records must be ≥ 1")
        if not self.checkpoint_every_seconds > 0:
            raise ValueError("checkpoint_every_seconds must be > 0")
        if self.min_free_bytes < 0 or self.max_batch < 1:
            raise ValueError("min_free_bytes must be ≥ 0 and max_batch ≥ 1")

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
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
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


@dataclass(slots=True)
class _Append:
    event: AuditEvent
    done: Future[AuditRecord]


@dataclass(slots=True)
class _Call:
    """Work that must run on the writer thread, after the appends queued with it."""

    action: Callable[[], Any]
    done: Future[Any]


class AuditLog:
    """The single writer. Invariants (`check_integrity`): the in-memory leaves are exactly
    the file's lines; the frontier root is their MTH; the last checkpoint is within size;
    `records_written` counts the records committed through `batches` writes."""

    def __init__(self, config: AuditLogConfig, clock: Callable[[], float],
                 key: Ed25519PrivateKey, log_fd: int, cp_fd: int) -> None:
        self.config = config
        self._clock = clock
        self._key = key
        self._log_fd = log_fd
        self._cp_fd = cp_fd
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[_Append | _Call] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._leaf_hashes: list[bytes] = []
        self._frontier = merkle.Frontier()
        self._log_bytes = 0
        self._cp_bytes = 0
        self._latest: SignedCheckpoint | None = None
        self._last_checkpoint_at = clock()
        self._anchor_pending: SignedCheckpoint | None = None
        self._broken: str | None = None
        self._closing = False
        self._closed = False
        self.epochs_at_open: dict[str, int] = {}
        self.batches = 0
        self.records_written = 0

    @classmethod
    def open(cls, config: AuditLogConfig,
             clock: Callable[[], float] = time.time) -> AuditLog:
        """Open (creating if needed), take the writer lock, repair a torn tail, verify, and
        start the writer thread."""
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
        audit = cls(config, clock, key, log_fd, cp_fd)
        try:
            repairs = audit._load()
        except BaseException:
            audit._release()
            raise
        audit._writer = threading.Thread(target=audit._run, name="fak-audit-writer",
                                         daemon=True)
        audit._writer.start()
        if repairs:
            try:
                audit.append(AuditEvent(kind="log_recovered", actor="governor",
                                        state=AuditState.RECORDED, reasons=tuple(repairs)))
            except BaseException:
                audit.close()
                raise
        return audit

    def _load(self) -> list[str]:
        repairs = self._repair_torn_tails()
        report, scan, checkpoints = verify_with_scan(self.config.log_path, None,
                                                     raw_public_key(self._key.public_key()).hex())
        if not report.ok:
            raise AuditLogCorrupt(report)
        self._leaf_hashes, self._frontier = scan.leaf_hashes, scan.frontier
        self.epochs_at_open = dict(scan.epochs)
        self._log_bytes = os.fstat(self._log_fd).st_size
        self._cp_bytes = os.fstat(self._cp_fd).st_size
        self._latest = checkpoints[-1] if checkpoints else None
        return repairs

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
        with self._lock:
            return self._frontier.size

    @property
    def latest_checkpoint(self) -> SignedCheckpoint | None:
        return self._latest

    def root_hash(self) -> str:
        with self._lock:
            return self._frontier.root().hex()

    def submit(self, event: AuditEvent) -> Future[AuditRecord]:
        """Queue one record for the writer; the future holds it once durable (or the
        AuditLogError that kept it out). Raises AuditLogError at once if the log refuses."""
        if not isinstance(event, AuditEvent):
            raise TypeError("append takes an AuditEvent")
        done: Future[AuditRecord] = Future()
        with self._lock:
            self._ensure_writable()
            self._queue.put(_Append(event, done))
        return done

    def append(self, event: AuditEvent) -> AuditRecord:
        """Commit one record (fsync'd) and return it; blocks the calling thread (CLI, tests,
        engine threads). The event loop uses `append_async`."""
        return self.submit(event).result()

    async def append_async(self, event: AuditEvent) -> AuditRecord:
        """Commit one record and return it once durable. A submitted record is written even
        if the awaiting task is cancelled (the shield): an action's record is never lost
        half-way."""
        return await asyncio.shield(asyncio.wrap_future(self.submit(event)))

    def refusal(self) -> str | None:
        """Why the log refuses appends (closed, or broken by a failed write), or None."""
        if self._closing or self._closed:
            return "the audit log is closed"
        if self._broken is not None:
            return f"the audit log refuses appends after a failed write: {self._broken}"
        return None

    def problem(self) -> str | None:
        """Why the log is not ready (None when it is): it refuses appends, or its
        filesystem has less than `min_free_bytes` free (appends go on while they fit)."""
        refusal = self.refusal()
        if refusal is not None:
            return refusal
        try:
            stat = os.statvfs(self.config.data_dir)
        except OSError as exc:
            return f"cannot stat the audit log's filesystem: {exc}"
        free = stat.f_bavail * stat.f_frsize
        if free < self.config.min_free_bytes:
            return (f"only {free} bytes free for the audit log in {self.config.data_dir} "
                    f"(min_free_bytes = {self.config.min_free_bytes})")
        return None

    def maybe_checkpoint(self) -> SignedCheckpoint | None:
        """Sign a checkpoint if one is due (call from a timer for the T-seconds rule)."""
        return self._call(self._maybe_checkpoint_now)

    async def maintain_async(self) -> SignedCheckpoint | None:
        """The timer's work, on the writer thread: a due checkpoint, then a retry of an
        anchor export that failed. Raises AnchorExportError while the export still fails."""
        return await asyncio.wrap_future(self._submit_call(self._maintain_now))

    def checkpoint(self) -> SignedCheckpoint:
        return self._call(self._checkpoint_now)

    def export_checkpoint(self) -> str:
        """The latest signed checkpoint covering every record, as canonical JSON (an anchor
        to copy to a store the log host cannot write)."""
        return self._call(self._export_now)

    def inclusion_proof(self, index: int, tree_size: int | None = None) -> list[str]:
        with self._lock:
            size = self._frontier.size if tree_size is None else tree_size
            self._check_size(size)
            leaves = self._leaf_hashes[:size]
        return [h.hex() for h in merkle.inclusion_proof(leaves, index)]

    def consistency_proof(self, old_size: int, new_size: int | None = None) -> list[str]:
        with self._lock:
            size = self._frontier.size if new_size is None else new_size
            self._check_size(size)
            leaves = self._leaf_hashes[:size]
        return [h.hex() for h in merkle.consistency_proof(leaves, old_size)]

    def close(self) -> None:
        """Commit what is queued, checkpoint anything uncovered, release the lock.
        Idempotent."""
        with self._lock:
            first = not self._closing
            self._closing = True
            if first and self._writer is not None:
                self._queue.put(_Call(self._shutdown, Future()))
        if self._writer is not None:
            self._writer.join()
        elif first:
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
            if self._latest is not None and self._latest.tree_size > self._frontier.size:
                raise AssertionError("latest checkpoint covers more than the log")
            if self.records_written and not 0 < self.batches <= self.records_written:
                raise AssertionError("more commits than records")

    def __enter__(self) -> AuditLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the writer thread -------------------------------------------------------------

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
            appends = [op for op in ops if isinstance(op, _Append)]
            try:
                if appends:
                    self._commit(appends)
            except Exception as exc:  # a bug must not leave callers waiting forever
                log.exception("audit writer failed")
                self._broken = self._broken or f"writer error: {exc!r}"
                for op in appends:
                    if not op.done.done():
                        op.done.set_exception(AuditLogError(self._broken))
            for call in ops:
                if isinstance(call, _Call):
                    resolve_call(call.done, call.action)

    def _commit(self, appends: list[_Append]) -> None:
        if self._broken is not None or self._closed:
            for op in appends:
                op.done.set_exception(AuditLogError(self.refusal() or "audit log closed"))
            return
        frontier = self._frontier.copy()
        now, leaves, chunks, records = self._now_ms(), [], [], []
        for op in appends:
            record = AuditRecord(frontier.size, now, op.event)
            line = encode_line(frontier.root(), record, self._key)
            leaf = merkle.leaf_hash(line)
            frontier.append(leaf)
            leaves.append(leaf)
            chunks.append(line + b"\n")
            records.append(record)
        data = b"".join(chunks)
        try:
            self._write(self._log_fd, data)
        except AuditLogError as exc:
            self._roll_back(self._log_fd, self._log_bytes)
            for op in appends:
                op.done.set_exception(exc)
            return
        with self._lock:
            self._frontier = frontier
            self._leaf_hashes.extend(leaves)
            self._log_bytes += len(data)
            self.batches += 1
            self.records_written += len(records)
        if self._checkpoint_due():
            with contextlib.suppress(AuditLogError):  # the log is broken now; later calls see it
                self._checkpoint_locked()
        for op, record in zip(appends, records, strict=True):
            op.done.set_result(record)  # durable: acknowledged even if the checkpoint failed

    def _maybe_checkpoint_now(self) -> SignedCheckpoint | None:
        self._ensure_writable()
        return self._checkpoint_locked() if self._checkpoint_due() else None

    def _checkpoint_now(self) -> SignedCheckpoint:
        self._ensure_writable()
        return self._checkpoint_locked()

    def _export_now(self) -> str:
        self._ensure_writable()
        latest = self._latest
        if latest is None or latest.tree_size != self._frontier.size:
            latest = self._checkpoint_locked()
        return canonical_json(asdict(latest)).decode()

    def _maintain_now(self) -> SignedCheckpoint | None:
        cp = self._maybe_checkpoint_now()
        pending = self._anchor_pending
        if pending is not None and self.config.anchor_dir is not None:
            export_anchor(self.config.anchor_dir, pending)
            if self._anchor_pending is pending:
                self._anchor_pending = None
        return cp

    def _shutdown(self) -> None:
        try:
            if self._broken is None and (self._latest is None
                                         or self._latest.tree_size != self._frontier.size):
                with contextlib.suppress(AuditLogError):
                    self._checkpoint_locked()
        finally:
            self._release()

    # -- internals ---------------------------------------------------------------------

    def _submit_call(self, action: Callable[[], T]) -> Future[T]:
        done: Future[T] = Future()
        with self._lock:
            if self._closing or self._closed:
                raise AuditLogError("audit log is closed")
            self._queue.put(_Call(action, done))
        return done

    def _call(self, action: Callable[[], T]) -> T:
        return self._submit_call(action).result()

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    def _check_size(self, size: int) -> None:
        if not 0 <= size <= self._frontier.size:
            raise ValueError(f"tree size {size} outside 0..{self._frontier.size}")

    def _ensure_writable(self) -> None:
        if self._closing or self._closed:
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

    def _roll_back(self, fd: int, length: int) -> None:
        """Cut a partly written batch off, so no record its caller saw fail stays behind."""
        try:
            os.ftruncate(fd, length)
            os.fsync(fd)
        except OSError as exc:
            self._broken = f"{self._broken}; cutting back to {length} bytes failed: {exc}"

    def _checkpoint_due(self) -> bool:
        covered = 0 if self._latest is None else self._latest.tree_size
        pending = self._frontier.size - covered
        waited = self._clock() - self._last_checkpoint_at
        return pending >= self.config.checkpoint_every_records or (
            pending > 0 and waited >= self.config.checkpoint_every_seconds)

    def _checkpoint_locked(self) -> SignedCheckpoint:
        cp = sign_checkpoint(self._key, self._frontier.size, self._frontier.root(),
                             self._now_ms())
        line = canonical_json(asdict(cp)) + b"\n"
        try:
            self._write(self._cp_fd, line)
        except AuditLogError:
            self._roll_back(self._cp_fd, self._cp_bytes)
            raise
        self._cp_bytes += len(line)
        self._latest = cp
        self._last_checkpoint_at = self._clock()
        if self.config.anchor_dir is not None:
            try:
                export_anchor(self.config.anchor_dir, cp)
                self._anchor_pending = None
            except AnchorExportError as exc:
                self._anchor_pending = cp  # retried by `maintain_async`
                log.warning("%s (retried by the checkpoint loop)", exc)
        return cp

    def _release(self) -> None:
        with self._lock:
            self._closed = True
        for fd in (self._cp_fd, self._log_fd):
            os.close(fd)


def claim(done: Future[T]) -> Future[T]:
    """The future a writer answers a dequeued op on: the op's own, now running so it can no
    longer be cancelled, or, where its caller already gave up (a `maintain_async` cancelled
    at shutdown), a fresh one no one reads. The op's work is done either way; answering a
    cancelled future would raise and end the writer thread, after which nothing queued would
    ever be committed and `close` would skip the final checkpoint."""
    return done if done.set_running_or_notify_cancel() else Future()


def resolve_call(done: Future[T], action: Callable[[], T]) -> None:
    try:
        done.set_result(action())
    except BaseException as exc:
        done.set_exception(exc)


def _publish_public_key(path: Path, key: Ed25519PrivateKey) -> None:
    public = raw_public_key(key.public_key()).hex()
    if path.exists():
        if path.read_text().strip() != public:
            raise AuditLogError(f"{path} does not match the signing key")
        return
    path.write_text(public + "\n")
