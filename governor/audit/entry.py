"""One audit-log entry and one signed checkpoint: their bytes, signatures and files.

An entry is one line of canonical JSON (sorted keys, compact, UTF-8)
`{"prev": <hex MTH of all earlier entries>, "record": <AuditRecord>, "sig": <hex Ed25519 over
prev+record>}`; its Merkle leaf is SHA-256(0x00 ‖ line bytes without the newline) (RFC 9162).
See governor.audit.log for the files and the writer policy.
"""


import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from governor.audit import merkle
from schemas.audit import AuditRecord, SignedCheckpoint

LOG_NAME = "audit.log"
KEY_NAME = "audit_signing.key"
RECORD_DOMAIN = b"fak-audit-record-v1\n"
CHECKPOINT_DOMAIN = b"fak-audit-checkpoint-v1\n"


class AuditLogError(Exception):
    """The audit log cannot be used (I/O, key or configuration problem)."""


class AuditLogBusy(AuditLogError):
    """Another process holds the writer lock."""


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


def checkpoints_path(log_path: Path) -> Path:
    return log_path.with_suffix(".checkpoints")


def public_key_path(log_path: Path) -> Path:
    return log_path.with_suffix(".pub")


def key_id(public_key: Ed25519PublicKey) -> str:
    return hashlib.sha256(raw_public_key(public_key)).hexdigest()


def raw_public_key(public_key: Ed25519PublicKey) -> bytes:
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
                            raw_public_key(key.public_key()).hex(), key.sign(message).hex())


def checkpoint_problem(cp: SignedCheckpoint, trusted: Ed25519PublicKey) -> str | None:
    """Why `cp` is not a valid checkpoint of the key `trusted`, or None."""
    if cp.public_key != raw_public_key(trusted).hex() or cp.key_id != key_id(trusted):
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


