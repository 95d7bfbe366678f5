"""Helper processes: one for the length of a test (a bench upstream, a bare proxy), started
with this interpreter from the repository root, ready once `ready_url` answers 200; a
server's command bound to the test run's life; the live members of a process group."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests.http_client import HTTP

REPO_ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def serving(args: list[str], ready_url: str, timeout_s: float = 60.0) -> Iterator[None]:
    proc = subprocess.Popen([sys.executable, *args], cwd=REPO_ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, args
            with contextlib.suppress(httpx.HTTPError):
                if HTTP.get(ready_url, timeout=2).status_code == 200:
                    break
            time.sleep(0.1)
        yield
    finally:
        proc.terminate()
        proc.wait(30)


def bound_to_this_process(cmd: list[str], grace_s: float = 30.0) -> list[str]:
    """`cmd` under tests/group_leader.py: its process group ends when the leader gets
    SIGTERM or when this process dies, however it dies (a run killed by SIGTERM or SIGKILL
    leaves no server behind); SIGKILL follows SIGTERM after `grace_s`. Start it in a
    session of its own (`start_new_session=True`), from any thread."""
    return [sys.executable, str(REPO_ROOT / "tests" / "group_leader.py"), str(os.getpid()),
            str(grace_s), *cmd]


def process_group_pids(pgid: int) -> list[int]:
    """The group's processes that have not exited (zombies left out)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if os.getpgid(int(entry.name)) == pgid and process_state(int(entry.name)) != "Z":
                pids.append(int(entry.name))
    return pids


def process_state(pid: int) -> str:
    """The state letter in /proc/PID/stat ("Z": a zombie); "" once the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[0]
