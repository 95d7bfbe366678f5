"""bench/cold_latency.py runs end to end: a real `fak serve` and the bare proxy beside the
instant upstream, one request at a time with gaps, every arm's row and its added latency."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "cold_latency.py"


def test_cold_latency_reports_every_arm_against_direct() -> None:
    run = subprocess.run([sys.executable, str(SCRIPT), "--rounds", "6", "--gap-ms", "5",
                          "--arms", "fak,aiohttp-aiohttp"],
                         capture_output=True, text=True, timeout=300,
                         cwd=SCRIPT.parents[1])
    assert run.returncode == 0, run.stderr[-3000:]
    rows = dict(re.findall(r"^\| (\S+) \| [\d.]+ \| [\d.]+ \| ([+-][\d.]+) \|$", run.stdout,
                           re.MULTILINE))
    assert set(rows) == {"direct", "fak", "aiohttp-aiohttp"}, run.stdout
    assert float(rows["direct"]) == 0.0
    assert float(rows["fak"]) > 0  # a proxy cannot answer before the upstream it asks
    assert "CPU:" in run.stdout and "one request every 5 ms, 6 rounds" in run.stdout
