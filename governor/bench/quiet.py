"""Waiting for a quiet machine before a measured block.

An engine can keep a core busy after its last answer: vLLM 0.32's CPU worker spun at 100% of
a core for 1-1.5 s after a block of 16 streams (`top`, 2-core Xeon with AMX). A block that
starts then shares the machine with the previous arm's tail: on that machine the native
engine's 16-stream TTFT went from ~480 ms to ~1,190 ms when its block followed vLLM's.
Interleaving spreads such a tail over the arms only when every arm leaves one; here it
punished whichever arm came after vLLM, at random. So before each measured block the runner
waits until the whole machine's busy share (`/proc/stat`, idle and iowait counted idle, over
`WINDOW_S`) is at most `max_busy`, for at most `timeout_s`, and records what it found.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

PROC_STAT = Path("/proc/stat")
WINDOW_S = 0.25
IDLE_FIELDS = (3, 4)  # idle, iowait in the "cpu" line's jiffies (proc(5))


@dataclass(frozen=True, slots=True)
class Settle:
    """What the wait found. `busy`: the last window's busy share of all CPUs (None where
    `/proc/stat` is absent or the wait is off); `settled`: None when nothing was checked."""

    waited_s: float
    busy: float | None
    settled: bool | None


NOT_CHECKED = Settle(0.0, None, None)


def cpu_jiffies(path: Path = PROC_STAT) -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs since boot; None where the file is absent or odd."""
    try:
        with path.open() as f:
            return parse_cpu_line(f.readline())
    except (OSError, UnicodeDecodeError):
        return None


def parse_cpu_line(line: str) -> tuple[int, int] | None:
    """(busy, total) from `/proc/stat`'s aggregate "cpu" line; None for any other line."""
    fields = line.split()
    if not fields or fields[0] != "cpu" or not all(x.isascii() and x.isdigit()
                                                    for x in fields[1:]):
        return None
    values = [int(x) for x in fields[1:9]]  # guest time is already counted in user time
    if len(values) <= max(IDLE_FIELDS):
        return None
    total = sum(values)
    return total - sum(values[i] for i in IDLE_FIELDS), total


def busy_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The busy share of all CPUs between two `cpu_jiffies` samples (0 when no tick passed)."""
    busy, total = after[0] - before[0], after[1] - before[1]
    return busy / total if total > 0 else 0.0


async def wait_quiet(max_busy: float, timeout_s: float, path: Path = PROC_STAT,
                     window_s: float = WINDOW_S) -> Settle:
    """Sleep window after window until one is at most `max_busy` busy or `timeout_s` has
    passed; `timeout_s` 0 turns the wait off."""
    start = time.monotonic()
    if timeout_s <= 0:
        return NOT_CHECKED
    before = cpu_jiffies(path)
    if before is None:
        return NOT_CHECKED
    while True:
        await asyncio.sleep(window_s)
        after = cpu_jiffies(path)
        if after is None:
            return Settle(time.monotonic() - start, None, None)
        busy = busy_share(before, after)
        waited = time.monotonic() - start
        if busy <= max_busy or waited >= timeout_s:
            return Settle(waited, busy, busy <= max_busy)
        before = after
