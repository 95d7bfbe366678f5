"""Checkpoint export to an anchor directory: a trust domain the log's host should not be able
to rewrite (another team's mount, a write-once bucket's sync folder; SEC-13).

Every signed checkpoint is written there as its own file,
`checkpoint-<tree_size, 12 digits>-<timestamp_ms>.json` (canonical JSON, created once, never
overwritten — what a write-once store allows). `latest_anchor` picks the one covering the most
records, so `fak audit verify --anchor DIR` checks the log against the newest export.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

from governor.audit.entry import AuditLogError, canonical_json
from schemas.audit import SignedCheckpoint

PREFIX = "checkpoint-"


class AnchorExportError(AuditLogError):
    """A checkpoint is durable in the log but could not be written to the anchor dir."""


def anchor_name(cp: SignedCheckpoint) -> str:
    return f"{PREFIX}{cp.tree_size:012d}-{cp.timestamp_ms}.json"


def export_anchor(anchor_dir: Path, cp: SignedCheckpoint) -> Path:
    """Write `cp` into `anchor_dir` (created if missing) and fsync it and the directory."""
    path = anchor_dir / anchor_name(cp)
    try:
        anchor_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            data = memoryview(canonical_json(asdict(cp)) + b"\n")
            while data:
                data = data[os.write(fd, data):]
            os.fsync(fd)
        finally:
            os.close(fd)
        dir_fd = os.open(anchor_dir, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as exc:
        raise AnchorExportError(f"cannot export checkpoint {cp.tree_size} to {anchor_dir}: "
                                f"{exc}") from exc
    return path


def latest_anchor(anchor_dir: Path) -> SignedCheckpoint:
    """The exported checkpoint covering the most records (the newest on a tie)."""
    best: SignedCheckpoint | None = None
    try:
        paths = sorted(anchor_dir.glob(f"{PREFIX}*.json"))
        for path in paths:
            cp = SignedCheckpoint.from_dict(json.loads(path.read_text()))
            if best is None or (cp.tree_size, cp.timestamp_ms) > (best.tree_size,
                                                                   best.timestamp_ms):
                best = cp
    except (OSError, ValueError, TypeError) as exc:
        raise AuditLogError(f"cannot read anchors in {anchor_dir}: {exc}") from exc
    if best is None:
        raise AuditLogError(f"no exported checkpoint in {anchor_dir}")
    return best
