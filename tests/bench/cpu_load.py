"""Child processes that keep every core this process may use busy for a while: a machine
another program is still working on (as vLLM CPU's worker spins after its last answer)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

SPIN = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass\n"


def spin_every_core(seconds: float) -> list[subprocess.Popen[bytes]]:
    """One busy child per usable core, each spinning `seconds` then exiting."""
    return [subprocess.Popen([sys.executable, "-c", SPIN.format(seconds=seconds)])
            for _ in range(len(os.sched_getaffinity(0)))]


def reap(children: list[subprocess.Popen[bytes]]) -> None:
    for child in children:
        child.kill()
        child.wait(10)


@contextmanager
def busy_machine(seconds: float = 120.0) -> Iterator[None]:
    children = spin_every_core(seconds)
    try:
        yield
    finally:
        reap(children)
