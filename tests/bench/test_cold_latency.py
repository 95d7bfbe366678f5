"""bench/cold_latency.py runs end to end: a real `fak serve` and the bare proxy beside the
instant upstream (started by the bench, or already running and named by `--upstream-url`),
one request at a time with gaps, every arm's row, its added latency with the interval and
its CPU time per request."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
SCRIPT = BENCH / "cold_latency.py"
ROW = re.compile(r"^\| (\S+) \| ([\d.]+) \| ([\d.]+) \| (.*) \| (.*) \|$", re.MULTILINE)
ADDED = re.compile(r"^([+-][\d.]+) \(([+-][\d.]+) – ([+-][\d.]+)\)$")


@pytest.fixture(scope="module")
def cold_latency() -> Iterator[ModuleType]:
    sys.path.insert(0, str(BENCH))  # the script imports its sibling line_rate
    try:
        yield importlib.import_module("cold_latency")
    finally:
        sys.path.remove(str(BENCH))


def rows_of(stdout: str) -> dict[str, tuple[str, str]]:
    """Each arm's added-latency and CPU cells."""
    return {name: (added, cpu) for name, _, _, added, cpu in ROW.findall(stdout)}


def run_bench(*args: str) -> subprocess.CompletedProcess[str]:
    run = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                         timeout=300, cwd=BENCH.parent)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


@pytest.mark.slow
def test_cold_latency_reports_every_arm_against_direct() -> None:
    run = run_bench("--rounds", "20", "--gap-ms", "5", "--arms", "fak,aiohttp-aiohttp")
    rows = rows_of(run.stdout)
    assert set(rows) == {"direct", "fak", "aiohttp-aiohttp"}, run.stdout
    assert rows["direct"] == ("", "")
    added = ADDED.match(rows["fak"][0])
    assert added is not None, rows
    point, low, high = map(float, added.groups())
    assert point > 0 and low <= point <= high  # a proxy cannot answer before its upstream
    assert float(rows["fak"][1]) >= 0 and float(rows["aiohttp-aiohttp"][1]) >= 0  # in /proc's ticks
    assert "CPU:" in run.stdout and "one request every 5 ms, 20 rounds" in run.stdout


@pytest.mark.slow
def test_cold_latency_runs_against_an_upstream_already_running(
        cold_latency: ModuleType, tmp_path: Path) -> None:
    line_rate = cold_latency.line_rate
    port = line_rate.free_port()
    upstream = f"http://127.0.0.1:{port}"
    with line_rate.process([sys.executable, str(BENCH / "instant_upstream.py"), "--port",
                            str(port)], upstream + "/health"):
        run = run_bench("--rounds", "20", "--gap-ms", "0", "--arms", "aiohttp-aiohttp",
                        "--upstream-url", upstream)
    rows = rows_of(run.stdout)
    assert set(rows) == {"direct", "aiohttp-aiohttp"}, run.stdout
    assert ADDED.match(rows["aiohttp-aiohttp"][0]), rows


def test_rounds_too_few_for_two_blocks_are_refused() -> None:
    run = subprocess.run([sys.executable, str(SCRIPT), "--rounds", "19"], capture_output=True,
                         text=True, timeout=60, cwd=BENCH.parent)
    assert run.returncode == 2 and "--rounds must be at least 20" in run.stderr


def test_fresh_bodies_differ_only_in_their_seeded_prompt(cold_latency: ModuleType) -> None:
    template = json.loads(cold_latency.line_rate.BODY)
    body = cold_latency.fresh_bodies()
    bodies = [json.loads(body()) for _ in range(50)]
    prompts = [body.pop("prompt") for body in bodies]
    assert all(b == {k: v for k, v in template.items() if k != "prompt"} for b in bodies)
    assert len(set(prompts)) == 50 and all(len(p.split()) == 30 for p in prompts)
    again = cold_latency.fresh_bodies()
    assert [json.loads(again())["prompt"] for _ in range(50)] == prompts  # seeded
