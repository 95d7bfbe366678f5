"""bench/body_stalls.py runs end to end: every body kind is refused by a real `fak serve`
while `/health` is timed, and the figures come out as JSON with the CPU they ran on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "body_stalls.py"


def test_body_stalls_measures_every_body_kind(tmp_path: Path) -> None:
    out = tmp_path / "stalls.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--max-body-bytes", str(128 << 10),
                          "--reps", "1", "--out", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["cpu_flags"] and result["max_body_bytes"] == 128 << 10
    assert set(result["results"]) == {"text", "token ids", "one long message",
                                      "many messages"}
    for runs in result["results"].values():
        assert [r["status"] for r in runs] == [400]  # past the engine's context
        assert runs[0]["health_max_ms"] > 0 and runs[0]["request_ms"] > 0
    assert "slowest /health" in run.stdout and "flags:" in run.stdout
