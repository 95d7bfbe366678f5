"""policies/ stays pure: no I/O, no clocks, no randomness, no mutable module state."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

POLICIES = Path(__file__).resolve().parents[2] / "policies"
FORBIDDEN_MODULES = {
    "asyncio", "datetime", "io", "logging", "os", "pathlib", "random", "secrets", "shutil",
    "socket", "subprocess", "sys", "tempfile", "threading", "time", "urllib",
}  # fmt: skip
FORBIDDEN_CALLS = {"open", "print", "input", "exec", "eval"}
MUTABLE_LITERALS = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)


def modules() -> list[Path]:
    return sorted(POLICIES.glob("*.py"))


def impurities(source: str) -> list[str]:
    tree = ast.parse(source)
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module.split(".")[0]]
        else:
            names = []
        problems += [f"imports {n}" for n in names if n in FORBIDDEN_MODULES]
        called = (
            node.func.id if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) else ""
        )
        if called in FORBIDDEN_CALLS:
            problems.append(f"calls {called}()")
        if isinstance(node, ast.Global | ast.Nonlocal):
            problems.append("uses global/nonlocal")
    for stmt in tree.body:
        value = getattr(stmt, "value", None)
        if isinstance(stmt, ast.Assign | ast.AnnAssign) and isinstance(value, MUTABLE_LITERALS):
            problems.append(f"mutable module-level value at line {stmt.lineno}")
    return problems


@pytest.mark.parametrize("path", modules(), ids=lambda p: p.name)
def test_module_is_pure(path: Path) -> None:
    assert impurities(path.read_text()) == [], path.name


def test_checker_catches_impurity() -> None:
    source = (
        "import time\nfrom os import path\nCACHE = {}\ndef f():\n    global CACHE\n    open('x')\n"
    )
    assert impurities(source) == [
        "imports time",
        "imports os",
        "uses global/nonlocal",
        "calls open()",
        "mutable module-level value at line 3",
    ]


def test_checker_sees_every_module() -> None:
    names = {p.name for p in modules()}
    assert {"salts.py", "priority.py", "quarantine.py", "determinism.py"} <= names
    assert {"measurement.py", "eviction.py"} <= names
