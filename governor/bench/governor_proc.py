"""A governor (`fak serve --config CONFIG`) started for the length of a benchmark, on
loopback ports it binds itself (port 0: a port chosen here and bound later could be taken
meanwhile, and the metrics listener's default, port + 1, was never checked at all; a test
run hit "address already in use"), with its own fresh data directory (a new salt key, its
own audit log) under the run's output directory, so a benchmark never touches an
operator's state. Its log is kept beside the results; its CPU time is read from /proc for
the overhead figures."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from governor.auth import sha256_hex
from governor.bench.config import BenchConfigError
from governor.config import GovernorConfig, load_config

STARTUP_TIMEOUT_S = 120.0
SERVING = re.compile(rb"fak: serving on (http://\S+) ")


class GovernorStartError(RuntimeError):
    """The governor did not become ready; the message carries its log tail."""


@dataclass
class GovernorProcess:
    url: str
    config: GovernorConfig
    log_path: Path
    process: subprocess.Popen[bytes]

    def cpu_seconds(self) -> float:
        """utime + stime of the governor process so far (Linux /proc)."""
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        return (int(fields[11]) + int(fields[12])) / ticks


def _tail(path: Path, chars: int = 3000) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace")[-chars:]
    return ""


def check_tenant_caps(config_path: Path, keys: Sequence[str], level: int, *,
                      queueing_counts: bool) -> None:
    """Refuse, before the run, a level the governor would answer partly with 429: a burst of
    `level` requests past the tenant's `max_concurrency` plus its queue is shed (unequal work,
    otherwise refused only after the whole run). With `queueing_counts` (the overhead run,
    where waiting in admission is not overhead) `max_concurrency` alone is the bound."""
    digests = {sha256_hex(k) for k in keys}
    for tenant in load_config(config_path).tenants:
        if not digests & set(tenant.api_key_sha256):
            continue
        bound = tenant.max_concurrency + (0 if queueing_counts else tenant.queue_limit)
        if bound < level:
            what = (f"max_concurrency {tenant.max_concurrency}" if queueing_counts else
                    f"max_concurrency {tenant.max_concurrency} + max_queued "
                    f"{tenant.queue_limit} = {bound}")
            raise BenchConfigError(
                f"tenant {tenant.id} of {config_path}: {what} < --concurrency {level}; the "
                f"governor would shed what the engine serves direct (raise it, and "
                f"max_queued, for the run)")


@contextlib.contextmanager
def running_governor(config_path: Path, workdir: Path) -> Iterator[GovernorProcess]:
    config = load_config(config_path)
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / "governor.log"
    cmd = [sys.executable, "-m", "governor.cli", "serve", "--config", str(config_path),
           "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--data-dir",
           str(workdir / "governor-data"), "--init-key"]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        yield GovernorProcess(_wait_ready(proc, log_path), config, log_path, proc)
    finally:
        _stop(proc)


def _wait_ready(proc: subprocess.Popen[bytes], log_path: Path) -> str:
    """The governor's URL, once it says where it serves and answers /ready there."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    with httpx.Client(timeout=2.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise GovernorStartError(f"governor exited with {proc.returncode}:\n"
                                         f"{_tail(log_path)}")
            serving = SERVING.search(log_path.read_bytes())
            with contextlib.suppress(httpx.TransportError):
                if serving and client.get(f"{serving[1].decode()}/ready").status_code == 200:
                    return serving[1].decode()
            time.sleep(0.2)
    raise GovernorStartError(f"governor not ready after {STARTUP_TIMEOUT_S:.0f} s:\n"
                             f"{_tail(log_path)}")


def _stop(proc: subprocess.Popen[bytes], grace_s: float = 20.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
