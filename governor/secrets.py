"""Secrets on disk: the salt key and the tenants' epochs. Missing or unreadable → refuse."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path

from schemas.audit import AuditEvent, AuditRecord

SALT_KEY_FILE = "salt.key"
EPOCHS_FILE = "epochs.json"
MIN_KEY_BYTES = 32

log = logging.getLogger("fak.secrets")


class StartupRefused(RuntimeError):
    """The governor must not start: the message says why."""


def _write_private(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
    except OSError:
        if fd >= 0:
            os.close(fd)
        tmp.unlink(missing_ok=True)
        raise


def load_salt_key(data_dir: Path, create: bool) -> bytes:
    """Read `<data_dir>/salt.key` (raw bytes, ≥ 32); create it (0600) only when allowed."""
    path = data_dir / SALT_KEY_FILE
    if not path.exists():
        if not create:
            raise StartupRefused(f"salt key {path} is missing; refusing to start")
        data_dir.mkdir(parents=True, exist_ok=True)
        _write_private(path, secrets.token_bytes(MIN_KEY_BYTES))
    try:
        key = path.read_bytes()
    except OSError as exc:
        raise StartupRefused(f"salt key {path} is unreadable ({exc}); refusing to start") from exc
    if len(key) < MIN_KEY_BYTES:
        raise StartupRefused(f"salt key {path} has {len(key)} bytes, needs ≥ {MIN_KEY_BYTES}")
    return key


class TenantEpochs:
    """Each tenant's salt epoch, persisted atomically so a rotation survives a restart.

    A rotation is recorded before it is visible (`rotate`): its audit record is durable
    first, then the epoch changes in memory, then `epochs.json` is rewritten. The log is the
    authority: `floor` (the latest `rotate` record per tenant, read when the log was
    opened) lifts any epoch the file missed, e.g. when the disk filled after the record.
    """

    def __init__(self, data_dir: Path, floor: Mapping[str, int] | None = None) -> None:
        self._path = data_dir / EPOCHS_FILE
        self._epochs: dict[str, int] = {}
        self._lock = asyncio.Lock()
        if self._path.exists():
            try:
                raw = json.loads(self._path.read_text())
            except (OSError, ValueError) as exc:
                raise StartupRefused(f"epochs file {self._path} is unreadable: {exc}") from exc
            self._epochs = {str(k): int(v) for k, v in raw.items()}
        for tenant, epoch in (floor or {}).items():
            self._epochs[tenant] = max(self._epochs.get(tenant, 0), epoch)

    def get(self, tenant: str) -> int:
        return self._epochs.get(tenant, 0)

    def problem(self) -> str | None:
        return None  # in memory and on local disk: always current

    def close(self) -> None:
        return None

    async def rotate(self, tenant: str, event_for: Callable[[int, int], AuditEvent],
                     append: Callable[[AuditEvent], Awaitable[AuditRecord]]) -> AuditRecord:
        """Bump `tenant`'s epoch, audited: `append(event_for(old, new))` returns the durable
        record before the new epoch is visible; if it raises, nothing changed. One at a
        time."""
        async with self._lock:
            old = self.get(tenant)
            committed = await append(event_for(old, old + 1))
            self._epochs[tenant] = old + 1
            snapshot = json.dumps(self._epochs, sort_keys=True).encode()
            try:
                await asyncio.to_thread(_write_private, self._path, snapshot)
            except OSError as exc:  # the record stands; the next start lifts the file to it
                log.error("epochs file %s not updated after rotate record %d: %s",
                          self._path, committed.index, exc)
            return committed
