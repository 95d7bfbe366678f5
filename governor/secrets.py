"""Secrets on disk: the salt key and the tenants' epochs. Missing or unreadable → refuse."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

SALT_KEY_FILE = "salt.key"
EPOCHS_FILE = "epochs.json"
MIN_KEY_BYTES = 32


class StartupRefused(RuntimeError):
    """The governor must not start: the message says why."""


def _write_private(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


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
    """Each tenant's salt epoch, persisted atomically so a rotation survives a restart."""

    def __init__(self, data_dir: Path) -> None:
        self._path = data_dir / EPOCHS_FILE
        self._epochs: dict[str, int] = {}
        if self._path.exists():
            try:
                raw = json.loads(self._path.read_text())
            except (OSError, ValueError) as exc:
                raise StartupRefused(f"epochs file {self._path} is unreadable: {exc}") from exc
            self._epochs = {str(k): int(v) for k, v in raw.items()}

    def get(self, tenant: str) -> int:
        return self._epochs.get(tenant, 0)

    def bump(self, tenant: str) -> tuple[int, int]:
        old = self.get(tenant)
        self._epochs[tenant] = old + 1
        _write_private(self._path, json.dumps(self._epochs, sort_keys=True).encode())
        return old, old + 1
