"""Imports point one way: schemas <- policies <- {native_engine, adapters} <- governor."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = {"schemas", "policies", "native_engine", "adapters", "governor"}
ALLOWED = {
    "schemas": {"schemas"},
    "policies": {"schemas", "policies"},
    "native_engine": {"schemas", "policies", "native_engine"},
    "adapters": {"schemas", "policies", "native_engine", "adapters"},
    "governor": OURS,
}


def imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & OURS


def test_every_package_exists() -> None:
    for pkg in OURS:
        assert (ROOT / pkg / "__init__.py").is_file(), pkg


def test_imports_point_one_way() -> None:
    violations = []
    for pkg, allowed in ALLOWED.items():
        for path in (ROOT / pkg).rglob("*.py"):
            bad = imported_packages(path) - allowed
            if bad:
                violations.append(f"{path.relative_to(ROOT)} imports {sorted(bad)}")
    assert not violations, "\n".join(violations)


def test_checker_catches_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "x.py"
    bad.write_text("from governor.cli import main\nimport adapters.vllm\n")
    assert imported_packages(bad) == {"governor", "adapters"}
