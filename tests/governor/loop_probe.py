"""How long a governor's event loop keeps answering while it works on something else."""

from __future__ import annotations

import threading
import time

import httpx


def health_latencies(url: str, stop: threading.Event, out: list[float]) -> None:
    """`/health` round trips, back to back, until `stop`: their times go to `out`."""
    with httpx.Client(timeout=30) as client:
        while not stop.is_set():
            start = time.perf_counter()
            client.get(url + "/health")
            out.append(time.perf_counter() - start)
