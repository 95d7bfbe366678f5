"""docs/security.md maps every requirement SEC-1..19 to code and tests that exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def mapping_rows() -> list[str]:
    text = (ROOT / "docs" / "security.md").read_text()
    lines = text[text.index("| requirement | where | test |"):].splitlines()[2:]
    rows = []
    for line in lines:  # the table ends at its first non-row line
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def covered(rows: list[str]) -> set[int]:
    found: set[int] = set()
    for row in rows:
        requirement = row.split("|")[1]
        for lo, hi in re.findall(r"SEC-(\d+)(?:\.\.(\d+))?", requirement):
            found.update(range(int(lo), int(hi or lo) + 1))
        for group in re.findall(r"SEC-((?:\d+/)+\d+)", requirement):
            found.update(int(n) for n in group.split("/"))
    return found


def test_every_requirement_has_a_row() -> None:
    assert set(range(1, 20)) - covered(mapping_rows()) == set()


def test_every_named_file_exists() -> None:
    for row in mapping_rows():
        for path in re.findall(r"`((?:tests|governor|adapters|policies|native_engine|schemas)"
                               r"/[^`:]*?)(?:::[^`]*)?`", row):
            assert (ROOT / path).exists(), f"docs/security.md names {path}, which is not there"


def test_every_named_test_exists() -> None:
    for row in mapping_rows():
        for path, name in re.findall(r"`(tests/[^`:]+\.py)::(test_[a-z0-9_]+)`", row):
            assert f"def {name}(" in (ROOT / path).read_text(), f"{path}::{name} is not there"
