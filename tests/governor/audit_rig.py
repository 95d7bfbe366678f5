"""Shared setup for the audit tests: a governor over an unstarted native driver (rotation and
the audit log need no engine), and a tiny filesystem that can really fill up."""

from __future__ import annotations

import asyncio
import contextlib
import resource
import signal
import subprocess
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adapters.native import NativeDriver
from governor.auth import sha256_hex
from governor.config import parse_config
from governor.serve import build_governor
from governor.state import Governor
from governor.store.protocols import AuditSink
from schemas.audit import AuditEvent, AuditRecord

ADMIN = "admin-token"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN}"}
TENANTS = ("acme", "beta")


def tenant_key(tenant: str) -> str:
    return f"key-{tenant}"


def governor_config(data_dir: Path, server: dict[str, Any] | None = None,
                    **audit: Any) -> dict[str, Any]:
    audit = {k: str(v) if isinstance(v, Path) else v for k, v in audit.items()}
    return {"server": {"data_dir": str(data_dir), "admin_token_sha256": sha256_hex(ADMIN),
                       **(server or {})},
            "engine": {"kind": "native"}, "audit": audit,
            "tenants": [{"id": t, "api_key_sha256": [sha256_hex(tenant_key(t))]}
                        for t in TENANTS]}


def governor_on(data_dir: Path, **audit: Any) -> Governor:
    return build_governor(parse_config(governor_config(data_dir, **audit)), NativeDriver(),
                          create_key=True)


@dataclass
class TinyDisk:
    """A filesystem of `size` bytes at `path`: a real tmpfs mount where this process may
    mount (root, as here and in CI); otherwise RLIMIT_FSIZE on this process, which makes
    every write past the current file sizes fail the way a full disk does (`how` says
    which ran)."""

    path: Path
    how: str
    _limit: tuple[int, int] | None = None

    def fill(self) -> None:
        if self.how == "tmpfs":
            with open(self.path / "filler", "wb", buffering=0) as f, \
                    contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * 4096)
            return
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        self._limit = resource.getrlimit(resource.RLIMIT_FSIZE)
        largest = max(p.stat().st_size for p in self.path.rglob("*") if p.is_file())
        resource.setrlimit(resource.RLIMIT_FSIZE, (largest + 64, self._limit[1]))

    def free(self) -> None:
        (self.path / "filler").unlink(missing_ok=True)
        if self._limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, self._limit)
            self._limit = None


@contextlib.contextmanager
def tiny_disk(path: Path, size: str = "512k") -> Iterator[TinyDisk]:
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                              str(path)], capture_output=True).returncode == 0
    disk = TinyDisk(path, "tmpfs" if mounted else "rlimit_fsize")
    try:
        yield disk
    finally:
        disk.free()
        if mounted:
            subprocess.run(["umount", "-l", str(path)], check=False)


async def cancel_a_maintain_behind(audit: AuditSink, events: Sequence[AuditEvent],
                                   last: AuditEvent) -> tuple[list[Future[AuditRecord]],
                                                              AuditRecord]:
    """Queue `events`, then a `maintain_async` that is cancelled at once (the checkpoint loop
    at shutdown); once the writer has answered past it, append `last` (waits at most 30 s:
    a writer thread that died answering the cancelled call would never answer it)."""
    queued = [audit.submit(e) for e in events]  # the writer is busy with these
    maintain = asyncio.create_task(audit.maintain_async())
    await asyncio.sleep(0)  # submitted, behind the appends
    maintain.cancel()
    while not all(f.done() for f in queued):  # the call is answered after these
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    return queued, await asyncio.wait_for(audit.append_async(last), 30)
