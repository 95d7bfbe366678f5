"""bench/instructions.py runs end to end: a real `fak serve` and the bare proxy under
callgrind beside the instant upstream, instructions per request for each."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "instructions.py"


def test_instructions_per_request_for_fak_and_the_bare_proxy(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, str(SCRIPT), "--requests", "60", "--warmup", "20",
                          "--concurrency", "4", "--keep", str(tmp_path)],
                         capture_output=True, text=True, timeout=900, cwd=SCRIPT.parents[1])
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {name: float(count.replace(",", "")) for name, count in re.findall(
        r"^\| (\S+) \| ([\d,]+) \| [\d.]+ \|$", run.stdout, re.MULTILINE)}
    assert set(rows) == {"fak", "aiohttp-aiohttp"}, run.stdout
    # A request through any aiohttp proxy is hundreds of thousands of instructions; fak's
    # checks come on top of the bare proxy's work.
    assert 100_000 < rows["aiohttp-aiohttp"] < rows["fak"] < 20_000_000, rows
    assert sorted(p.name for p in tmp_path.iterdir()) == ["aiohttp-aiohttp.callgrind",
                                                           "fak.callgrind"]
    assert "CPU:" in run.stdout and "60 requests (non-streaming" in run.stdout


def test_a_supervised_arm_is_refused() -> None:
    run = subprocess.run([sys.executable, str(SCRIPT), "--arms", "fak-w2"],
                         capture_output=True, text=True, timeout=60, cwd=SCRIPT.parents[1])
    assert run.returncode == 2 and "cannot be counted" in run.stderr


def test_a_negative_pause_between_events_is_refused() -> None:
    run = subprocess.run([sys.executable, str(SCRIPT), "--stream-tokens", "4",
                          "--stream-interval-ms", "-1"],
                         capture_output=True, text=True, timeout=60, cwd=SCRIPT.parents[1])
    assert run.returncode == 2 and "--stream-interval-ms must be >= 0" in run.stderr
