"""bench/line_rate.py's paired comparison of two fak trees, on results given by hand."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "line_rate.py"
_spec = importlib.util.spec_from_file_location("line_rate_under_test", SCRIPT)
assert _spec is not None and _spec.loader is not None
line_rate = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = line_rate  # its dataclasses look their module up by name
_spec.loader.exec_module(line_rate)


def result(rps: float, cpu_us: float | None) -> Any:
    return line_rate.WrkResult(rps=rps, p50_ms=1.0, p99_ms=2.0, errors=0, cpu_us=cpu_us)


def test_ratios_are_paired_by_rep_with_their_range() -> None:
    results = {("fak", 16): [result(110, 90), result(90, 110), result(120, 80)],
               ("base", 16): [result(100, 100), result(100, 100), result(100, 100)],
               ("fak", 64): [result(100, None)], ("base", 64): [result(0, None)]}
    assert line_rate.paired_ratios(results, [16, 64], "fak", "base") == [
        "c=16: req/s ×1.100 (0.900–1.200), CPU per request ×0.900 (0.800–1.100) over 3 reps",
        "c=64: base answered nothing"]


def test_a_rep_is_compared_with_its_own_rep_not_the_medians() -> None:
    # The medians' ratio would be 100 / 90 = 1.111; the reps' own ratios are 1.143, 1.111
    # and 1.3.
    results = {("fak", 1): [result(80, None), result(100, None), result(130, None)],
               ("base", 1): [result(70, None), result(90, None), result(100, None)]}
    assert line_rate.paired_ratios(results, [1], "fak", "base") == [
        "c=1: req/s ×1.143 (1.111–1.300) over 3 reps"]
