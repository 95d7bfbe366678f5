"""Tamper-evident, append-only audit log (security.md §7, SEC-12/13/14/18).

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

The Merkle leaf of entry i is SHA-256(0x00 ‖ line bytes without the newline) (RFC 9162).

How `verify` names the first bad index: each entry carries its own index and is signed, and
its `prev` must equal the root of everything before it. A flipped byte breaks the JSON, the
canonical form or the signature *of that entry*; a deleted, swapped or inserted entry puts the
wrong index at that position; an entry replaced with later hashes recomputed still fails its
own signature. An attacker holding the signing key can rewrite everything consistently; only
an anchor (an exported checkpoint kept where the log host cannot write) catches that, and
tail truncation or rollback, through the checkpoint's root and a consistency proof.

A last line without its newline is a torn tail (a crash mid-append): it was never
acknowledged, so it is reported, not counted, and everything before it still verifies.

Writer policy: `AuditLog.open` verifies the whole log with its own key first and refuses to
write to a log that fails (`AuditLogCorrupt`) — appending to a forged history would bless
it. A torn tail is moved to `audit.log.torn-<offset>` and the recovery is itself recorded.
An append that fails leaves the log refusing further appends until reopened, so the
governor fails closed (SEC-18). One writer at a time (an exclusive `flock`).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from governor import merkle
from schemas.audit import AuditEvent, AuditRecord, AuditState, SignedCheckpoint

LOG_NAME = "audit.log"
KEY_NAME = "audit_signing.key"
RECORD_DOMAIN = b"fak-audit-record-v1\n"
CHECKPOINT_DOMAIN = b"fak-audit-checkpoint-v1\n"


class AuditLogError(Exception):
    """The audit log cannot be used (I/O, key or configuration problem)."""


class AuditLogBusy(AuditLogError):
    """Another process holds the writer lock."""


class AuditLogCorrupt(AuditLogError):
    """The log failed verification; the writer refuses to extend it."""

    def __init__(self, report: VerifyReport) -> None:
        super().__init__(report.summary())
        self.report = report


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


def checkpoints_path(log_path: Path) -> Path:
    return log_path.with_suffix(".checkpoints")


def public_key_path(log_path: Path) -> Path:
    return log_path.with_suffix(".pub")


def key_id(public_key: Ed25519PublicKey) -> str:
    return hashlib.sha256(_raw(public_key)).hexdigest()


def _raw(public_key: Ed25519PublicKey) -> bytes:
    return public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def encode_line(prev_root: bytes, record: AuditRecord, key: Ed25519PrivateKey) -> bytes:
    """One log entry, without its newline. The signature binds index, prev root and record."""
    body = {"prev": prev_root.hex(), "record": asdict(record)}
    signature = key.sign(RECORD_DOMAIN + canonical_json(body))
    return canonical_json({**body, "sig": signature.hex()})


def _checkpoint_message(tree_size: int, root_hash: str, timestamp_ms: int, kid: str) -> bytes:
    fields = {"key_id": kid, "root_hash": root_hash, "timestamp_ms": timestamp_ms,
              "tree_size": tree_size}
    return CHECKPOINT_DOMAIN + canonical_json(fields)


def sign_checkpoint(
    key: Ed25519PrivateKey, tree_size: int, root_hash: bytes, timestamp_ms: int
) -> SignedCheckpoint:
    kid = key_id(key.public_key())
    message = _checkpoint_message(tree_size, root_hash.hex(), timestamp_ms, kid)
    return SignedCheckpoint(tree_size, root_hash.hex(), timestamp_ms, kid,
                            _raw(key.public_key()).hex(), key.sign(message).hex())


def checkpoint_problem(cp: SignedCheckpoint, trusted: Ed25519PublicKey) -> str | None:
    """Why `cp` is not a valid checkpoint of the key `trusted`, or None."""
    if cp.public_key != _raw(trusted).hex() or cp.key_id != key_id(trusted):
        return "signed by a different key"
    message = _checkpoint_message(cp.tree_size, cp.root_hash, cp.timestamp_ms, cp.key_id)
    try:
        trusted.verify(bytes.fromhex(cp.signature), message)
    except InvalidSignature:
        return "bad signature"
    return None


def self_signed_key(cp: SignedCheckpoint) -> Ed25519PublicKey:
    """The key a checkpoint names (trust it only when the checkpoint came from an anchor)."""
    return Ed25519PublicKey.from_public_bytes(bytes.fromhex(cp.public_key))


def check_append_only(
    anchor: SignedCheckpoint, current: SignedCheckpoint, proof: Sequence[str]
) -> tuple[str, ...]:
    """What a witness checks before accepting `current` after `anchor` (SEC-13): same key,
    both signatures, no shrinking, and a consistency proof from anchor to current."""
    trusted = self_signed_key(anchor)
    problems = [f"anchor: {p}" for p in [checkpoint_problem(anchor, trusted)] if p]
    problems += [f"checkpoint: {p}" for p in [checkpoint_problem(current, trusted)] if p]
    if current.tree_size < anchor.tree_size:
        problems.append(f"rollback: checkpoint covers {current.tree_size} records, "
                        f"the anchor {anchor.tree_size}")
    elif not merkle.verify_consistency(
        anchor.tree_size, current.tree_size, bytes.fromhex(anchor.root_hash),
        bytes.fromhex(current.root_hash), [bytes.fromhex(p) for p in proof],
    ):
        problems.append("consistency proof from the anchor fails: history was rewritten")
    return tuple(problems)


# --- verification ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """Outcome of `verify`. `ok` is the verdict. `first_bad_index` names the first record
    shown bad (for a truncation: the first missing one); None when nothing is bad or when a
    mismatch with the anchor cannot be localised. `records` counts the entries verified in
    order from 0; `torn_tail_bytes` the unacknowledged bytes after the last newline."""

    ok: bool
    records: int
    first_bad_index: int | None
    problems: tuple[str, ...]
    torn_tail_bytes: int
    checkpoints: int
    checkpointed_size: int
    root_hash: str
    anchor_size: int | None = None

    def summary(self) -> str:
        lines = [
            f"audit log: {'OK' if self.ok else 'TAMPERED'} — {self.records} record(s) verified, "
            f"root {self.root_hash}",
            f"checkpoints: {self.checkpoints} verified, covering {self.checkpointed_size} "
            f"record(s)" + (f"; anchor covers {self.anchor_size}" if self.anchor_size is not None
                            else "; no anchor (truncation is undetectable without one)"),
        ]
        if self.first_bad_index is not None:
            lines.append(f"first bad index: {self.first_bad_index}")
        if self.torn_tail_bytes:
            lines.append(f"torn tail: {self.torn_tail_bytes} byte(s) after the last complete "
                         f"record (an interrupted append; not counted)")
        lines += [f"problem: {p}" for p in self.problems]
        return "\n".join(lines)


@dataclass(slots=True)
class _Scan:
    """Running state of one pass over the log lines."""

    leaf_hashes: list[bytes] = field(default_factory=list)
    frontier: merkle.Frontier = field(default_factory=merkle.Frontier)
    roots: dict[int, bytes] = field(default_factory=dict)
    first_bad: int | None = None
    problem: str | None = None
    torn_bytes: int = 0


def _split_lines(data: bytes) -> tuple[list[bytes], int]:
    """Complete lines and the length of an unterminated tail."""
    end = data.rfind(b"\n") + 1
    return data[:end].split(b"\n")[:-1], len(data) - end


def _line_problem(line: bytes, index: int, prev: bytes, key: Ed25519PublicKey) -> str | None:
    try:
        entry = json.loads(line)
    except ValueError:
        return "not valid JSON"
    if not isinstance(entry, dict) or set(entry) != {"prev", "record", "sig"}:
        return "not a log entry"
    record = entry["record"]
    if not isinstance(record, dict) or record.get("index") != index:
        found = record.get("index") if isinstance(record, dict) else None
        return f"holds record index {found!r} at position {index} (deleted, inserted or moved)"
    if canonical_json(entry) != line:
        return "bytes are not the canonical encoding (edited)"
    if entry["prev"] != prev.hex():
        return "prev root does not match the records before it"
    try:
        body = canonical_json({"prev": entry["prev"], "record": record})
        key.verify(bytes.fromhex(entry["sig"]), RECORD_DOMAIN + body)
    except (InvalidSignature, ValueError, TypeError):
        return "bad signature (edited or signed by another key)"
    try:
        AuditRecord.from_dict(record)
    except (ValueError, TypeError) as exc:
        return f"signed but malformed record: {exc}"
    return None


def _scan_log(data: bytes, key: Ed25519PublicKey, wanted_sizes: set[int]) -> _Scan:
    scan = _Scan()
    lines, scan.torn_bytes = _split_lines(data)
    for index, line in enumerate(lines):
        if index in wanted_sizes:
            scan.roots[index] = scan.frontier.root()
        problem = _line_problem(line, index, scan.frontier.root(), key)
        if problem:
            scan.first_bad, scan.problem = index, f"record {index}: {problem}"
            return scan
        leaf = merkle.leaf_hash(line)
        scan.leaf_hashes.append(leaf)
        scan.frontier.append(leaf)
    scan.roots[scan.frontier.size] = scan.frontier.root()
    return scan


def _read_checkpoints(path: Path) -> tuple[list[SignedCheckpoint], list[str]]:
    if not path.exists():
        return [], []
    lines, _torn = _split_lines(path.read_bytes())
    checkpoints, problems = [], []
    for n, line in enumerate(lines):
        try:
            cp = SignedCheckpoint.from_dict(json.loads(line))
        except (ValueError, TypeError) as exc:
            problems.append(f"checkpoint #{n}: unreadable ({exc})")
            continue
        if canonical_json(asdict(cp)) != line:
            problems.append(f"checkpoint #{n}: bytes are not the canonical encoding (edited)")
            continue
        checkpoints.append(cp)
    return checkpoints, problems


def _check_checkpoints(
    checkpoints: list[SignedCheckpoint], scan: _Scan, key: Ed25519PublicKey
) -> tuple[int, int, list[str], list[int]]:
    """(verified, largest verified size, problems, candidate first-bad indices)."""
    verified, good_size, problems, bad = 0, 0, [], []
    last_size = 0
    for n, cp in enumerate(checkpoints):
        problem = checkpoint_problem(cp, key)
        if problem is None and cp.tree_size < last_size:
            problem = f"tree size {cp.tree_size} is below the previous {last_size}"
        if problem is None and cp.tree_size > scan.frontier.size:
            if scan.first_bad is None:
                problem = (f"covers {cp.tree_size} records but only {scan.frontier.size} "
                           f"remain (truncated)")
                bad.append(scan.frontier.size)
            else:
                continue  # beyond the first bad record: nothing more can be checked
        if problem is None and scan.roots[cp.tree_size].hex() != cp.root_hash:
            problem = f"root differs: a record in [{good_size}, {cp.tree_size}) was rewritten"
            bad.append(good_size)
        last_size = max(last_size, cp.tree_size)
        if problem:
            problems.append(f"checkpoint #{n} (size {cp.tree_size}): {problem}")
        else:
            verified, good_size = verified + 1, max(good_size, cp.tree_size)
    return verified, good_size, problems, bad


def _check_anchor(anchor: SignedCheckpoint, scan: _Scan) -> tuple[list[str], list[int]]:
    own = checkpoint_problem(anchor, self_signed_key(anchor))
    if own:
        return [f"anchor: {own}"], []
    size = scan.frontier.size
    if size < anchor.tree_size:
        return [f"anchor covers {anchor.tree_size} records but only {size} verify "
                f"(truncated or rolled back)"], [size]
    proof = merkle.consistency_proof(scan.leaf_hashes, anchor.tree_size)
    if not merkle.verify_consistency(anchor.tree_size, size, bytes.fromhex(anchor.root_hash),
                                     scan.frontier.root(), proof):
        return [f"the first {anchor.tree_size} records are not the anchored history "
                f"(rewritten or rolled back)"], []
    return [], []


def _trusted_key(
    log_path: Path, anchor: SignedCheckpoint | None, public_key: str | None
) -> tuple[Ed25519PublicKey, list[str]]:
    pub_file = public_key_path(log_path)
    local = pub_file.read_text().strip() if pub_file.exists() else None
    if anchor is not None:
        trusted = anchor.public_key
        problems = [f"{pub_file.name} differs from the anchor's key"] if local not in (
            None, trusted) else []
    else:
        trusted = public_key or local
        problems = []
        if trusted is None:
            raise AuditLogError(f"no public key: pass one or an anchor, or restore {pub_file}")
    try:
        return Ed25519PublicKey.from_public_bytes(bytes.fromhex(trusted)), problems
    except ValueError as exc:
        raise AuditLogError(f"unusable public key: {exc}") from exc


def verify(
    log_path: Path | str,
    anchor: SignedCheckpoint | None = None,
    public_key: str | None = None,
) -> VerifyReport:
    """Verify the log at `log_path` end to end (SEC-12), and against `anchor` (SEC-13).

    The trusted key is the anchor's, else `public_key` (hex), else `audit.pub` beside the log.
    Without an anchor the result proves internal consistency only.
    """
    return _verify(Path(log_path), anchor, public_key)[0]


def _verify(
    log_path: Path, anchor: SignedCheckpoint | None, public_key: str | None
) -> tuple[VerifyReport, _Scan, list[SignedCheckpoint]]:
    key, problems = _trusted_key(log_path, anchor, public_key)
    checkpoints, cp_read_problems = _read_checkpoints(checkpoints_path(log_path))
    problems += cp_read_problems
    wanted = {cp.tree_size for cp in checkpoints}
    scan = _scan_log(log_path.read_bytes(), key, wanted)
    bad = [] if scan.first_bad is None else [scan.first_bad]
    if scan.problem:
        problems.append(scan.problem)
    verified, covered, cp_problems, cp_bad = _check_checkpoints(checkpoints, scan, key)
    problems += cp_problems
    bad += cp_bad
    if anchor is not None and scan.first_bad is None:
        anchor_problems, anchor_bad = _check_anchor(anchor, scan)
        problems += anchor_problems
        bad += anchor_bad
    report = VerifyReport(
        ok=not problems,
        records=scan.frontier.size,
        first_bad_index=min(bad) if bad else None,
        problems=tuple(problems),
        torn_tail_bytes=scan.torn_bytes,
        checkpoints=verified,
        checkpointed_size=covered,
        root_hash=scan.frontier.root().hex(),
        anchor_size=None if anchor is None else anchor.tree_size,
    )
    return report, scan, checkpoints


# --- the writer -----------------------------------------------------------------------


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
        _write_all(fd, pem, sync=True)
    finally:
        os.close(fd)
    return key


def _write_all(fd: int, data: bytes, sync: bool) -> None:
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
        report, scan, checkpoints = _verify(self.config.log_path, None,
                                            _raw(self._key.public_key()).hex())
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
            _write_all(fd, data, sync=self.config.fsync)
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
    public = _raw(key.public_key()).hex()
    if path.exists():
        if path.read_text().strip() != public:
            raise AuditLogError(f"{path} does not match the signing key")
        return
    path.write_text(public + "\n")


# --- CLI entry points (wired by governor/cli.py) -----------------------------------------


def load_anchor(path: Path | str) -> SignedCheckpoint:
    try:
        return SignedCheckpoint.from_dict(json.loads(Path(path).read_text()))
    except (OSError, ValueError, TypeError) as exc:
        raise AuditLogError(f"cannot read anchor {path}: {exc}") from exc


def cmd_audit_verify(log: Path | str, anchor: Path | str | None = None) -> int:
    """`fak audit verify LOG [--anchor CHECKPOINT]`. Exit 0 intact, 1 tampered, 2 unusable
    input, 3 intact but with a torn tail (an interrupted append)."""
    try:
        if not Path(log).is_file():
            raise AuditLogError(f"no audit log at {log}")
        report = verify(log, None if anchor is None else load_anchor(anchor))
    except AuditLogError as exc:
        print(f"fak audit verify: {exc}", file=sys.stderr)
        return 2
    print(report.summary())
    if not report.ok:
        return 1
    return 3 if report.torn_tail_bytes else 0


def cmd_audit_checkpoint(data_dir: Path | str) -> int:
    """`fak audit checkpoint`: print a signed checkpoint covering the whole log, to keep as
    an anchor. With the governor running (writer lock held) the latest stored one is
    printed, and stderr says how many records it does not cover yet."""
    config = AuditLogConfig(Path(data_dir))
    if not config.log_path.is_file():
        print(f"fak audit checkpoint: no audit log at {config.log_path}", file=sys.stderr)
        return 2
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


def _print_stored_checkpoint(log_path: Path) -> int:
    report = verify(log_path)
    checkpoints, _ = _read_checkpoints(checkpoints_path(log_path))
    if not report.ok or not checkpoints:
        print(report.summary() if not report.ok else "no checkpoint yet", file=sys.stderr)
        return 1
    latest = checkpoints[-1]
    print(canonical_json(asdict(latest)).decode())
    if latest.tree_size < report.records:
        print(f"note: {report.records - latest.tree_size} record(s) after this checkpoint; "
              f"the running governor signs the next one", file=sys.stderr)
    return 0
