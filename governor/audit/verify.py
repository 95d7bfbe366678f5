"""Verify an audit log: name the first bad index, check checkpoints and an anchor.

How the first bad index is named: each entry carries its own index and is signed, and its
`prev` must equal the root of everything before it. A flipped byte breaks the JSON, the
canonical form or the signature *of that entry*; a deleted, swapped or inserted entry puts the
wrong index at that position; an entry replaced with later hashes recomputed still fails its
own signature. An attacker holding the signing key can rewrite everything consistently; only
an anchor (an exported checkpoint kept where the log host cannot write) catches that, and
tail truncation or rollback, through the checkpoint's root and a consistency proof.

A last line without its newline is a torn tail (a crash mid-append): it was never
acknowledged, so it is reported, not counted, and everything before it still verifies.
"""


import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from governor.audit import merkle
from governor.audit.entry import (
    RECORD_DOMAIN,
    AuditLogError,
    canonical_json,
    checkpoint_problem,
    checkpoints_path,
    public_key_path,
    self_signed_key,
)
from schemas.audit import AuditRecord, SignedCheckpoint


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


class AuditLogCorrupt(AuditLogError):
    """The log failed verification; the writer refuses to extend it."""

    def __init__(self, report: VerifyReport) -> None:
        super().__init__(report.summary())
        self.report = report


@dataclass(slots=True)
class LogScan:
    """Running state of one pass over the log lines."""

    leaf_hashes: list[bytes] = field(default_factory=list)
    frontier: merkle.Frontier = field(default_factory=merkle.Frontier)
    roots: dict[int, bytes] = field(default_factory=dict)
    first_bad: int | None = None
    problem: str | None = None
    torn_bytes: int = 0
    epochs: dict[str, int] = field(default_factory=dict)  # the latest rotate per tenant


def _split_lines(data: bytes) -> tuple[list[bytes], int]:
    """Complete lines and the length of an unterminated tail."""
    end = data.rfind(b"\n") + 1
    return data[:end].split(b"\n")[:-1], len(data) - end


def _line_problem(line: bytes, index: int, prev: bytes,
                  key: Ed25519PublicKey) -> tuple[str | None, dict[str, Any]]:
    """Why the line at `index` is bad (None if good), and its record as parsed."""
    try:
        entry = json.loads(line)
    except ValueError:
        return "not valid JSON", {}
    if not isinstance(entry, dict) or set(entry) != {"prev", "record", "sig"}:
        return "not a log entry", {}
    record = entry["record"]
    if not isinstance(record, dict) or record.get("index") != index:
        found = record.get("index") if isinstance(record, dict) else None
        return f"holds record index {found!r} at position {index} (deleted, inserted or moved)", {}
    if canonical_json(entry) != line:
        return "bytes are not the canonical encoding (edited)", {}
    if entry["prev"] != prev.hex():
        return "prev root does not match the records before it", {}
    try:
        body = canonical_json({"prev": entry["prev"], "record": record})
        key.verify(bytes.fromhex(entry["sig"]), RECORD_DOMAIN + body)
    except (InvalidSignature, ValueError, TypeError):
        return "bad signature (edited or signed by another key)", {}
    try:
        AuditRecord.from_dict(record)
    except (ValueError, TypeError) as exc:
        return f"signed but malformed record: {exc}", {}
    return None, record


def _note_rotation(scan: LogScan, record: dict[str, Any]) -> None:
    event = record["event"]
    evidence = event["evidence"] or {}
    if event["kind"] == "rotate" and event["tenant"] and evidence.get("new_epoch") is not None:
        tenant = event["tenant"]
        scan.epochs[tenant] = max(scan.epochs.get(tenant, 0), evidence["new_epoch"])


def _scan_log(data: bytes, key: Ed25519PublicKey, wanted_sizes: set[int]) -> LogScan:
    scan = LogScan()
    lines, scan.torn_bytes = _split_lines(data)
    for index, line in enumerate(lines):
        if index in wanted_sizes:
            scan.roots[index] = scan.frontier.root()
        problem, record = _line_problem(line, index, scan.frontier.root(), key)
        if problem:
            scan.first_bad, scan.problem = index, f"record {index}: {problem}"
            return scan
        _note_rotation(scan, record)
        leaf = merkle.leaf_hash(line)
        scan.leaf_hashes.append(leaf)
        scan.frontier.append(leaf)
    scan.roots[scan.frontier.size] = scan.frontier.root()
    return scan


def read_checkpoints(path: Path) -> tuple[list[SignedCheckpoint], list[str]]:
    if not path.exists():
        return [], []
    lines, _torn = _split_lines(path.read_bytes())
    return parse_checkpoints(lines)


def parse_checkpoints(lines: list[bytes]) -> tuple[list[SignedCheckpoint], list[str]]:
    """Checkpoints from their canonical lines; unreadable or edited ones are problems."""
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
    checkpoints: list[SignedCheckpoint], scan: LogScan, key: Ed25519PublicKey
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


def _check_anchor(anchor: SignedCheckpoint, scan: LogScan) -> tuple[list[str], list[int]]:
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
    local: str | None, where: str, anchor: SignedCheckpoint | None, public_key: str | None
) -> tuple[Ed25519PublicKey, list[str]]:
    """The key to verify with: the anchor's, else `public_key`, else `local` (the key stored
    beside the log, at `where`)."""
    if anchor is not None:
        trusted: str | None = anchor.public_key
        problems = [f"{where} differs from the anchor's key"] if local not in (
            None, trusted) else []
    else:
        trusted = public_key or local
        problems = []
    if trusted is None:
        raise AuditLogError(f"no public key: pass one or an anchor, or restore {where}")
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
    return verify_with_scan(Path(log_path), anchor, public_key)[0]


def verify_with_scan(
    log_path: Path, anchor: SignedCheckpoint | None, public_key: str | None
) -> tuple[VerifyReport, LogScan, list[SignedCheckpoint]]:
    pub_file = public_key_path(log_path)
    local = pub_file.read_text().strip() if pub_file.exists() else None
    key, problems = _trusted_key(local, pub_file.name, anchor, public_key)
    checkpoints, cp_read_problems = read_checkpoints(checkpoints_path(log_path))
    return verify_data(log_path.read_bytes(), checkpoints, key, anchor,
                       problems + cp_read_problems)


def verify_data(
    data: bytes, checkpoints: list[SignedCheckpoint], key: Ed25519PublicKey,
    anchor: SignedCheckpoint | None, problems: list[str],
) -> tuple[VerifyReport, LogScan, list[SignedCheckpoint]]:
    """Verify log bytes (entries, one per line) and their checkpoints with `key`; the file
    and the database log share this (governor.store.pg_audit)."""
    problems = list(problems)
    wanted = {cp.tree_size for cp in checkpoints}
    scan = _scan_log(data, key, wanted)
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
