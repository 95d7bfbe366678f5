"""A helper process (a bench upstream, a bare proxy) for the length of a test: started with
this interpreter from the repository root, ready once `ready_url` answers 200."""

from __future__ import annotations

import contextlib
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
