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


# -- inside native_engine: kernels ← model ← core ← serve; kvcache beside model -------------

NATIVE_LAYERS = {
    "native_engine.kernels": {"native_engine.kernels"},
    "native_engine.kvcache": {"native_engine.kvcache"},
    "native_engine.model": {"native_engine.kernels", "native_engine.model"},
    "native_engine": {"native_engine.kernels", "native_engine.kvcache", "native_engine.model",
                      "native_engine"},
    "native_engine.serve": {"native_engine.kernels", "native_engine.kvcache",
                            "native_engine.model", "native_engine", "native_engine.serve"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Every module of ours that `path` imports (lazy imports included), resolved to the
    deepest existing module: `from a.b import c` is a.b.c when c is a module, else a.b."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module
            if node.level:
                pkg = module_name(path).split(".")
                pkg = pkg[: len(pkg) - node.level + (path.name == "__init__.py")]
                base = ".".join([*pkg, node.module])
            names.update(f"{base}.{alias.name}" for alias in node.names)
            names.add(base)
    return {resolve(n) for n in names if n.split(".")[0] in OURS | {"tests", "bench"}}


def resolve(name: str) -> str:
    parts = name.split(".")
    while parts:
        candidate = ROOT.joinpath(*parts)
        if candidate.with_suffix(".py").is_file() or (candidate / "__init__.py").is_file():
            return ".".join(parts)
        parts.pop()
    return name


def layer_of(module: str) -> str:
    for layer in sorted(NATIVE_LAYERS, key=len, reverse=True):
        if module == layer or module.startswith(layer + "."):
            return layer
    raise AssertionError(module)


def product_files() -> list[Path]:
    return [p for pkg in [*OURS, "bench"] for p in (ROOT / pkg).rglob("*.py")]


def test_native_engine_layers() -> None:
    violations = []
    for path in (ROOT / "native_engine").rglob("*.py"):
        layer = layer_of(module_name(path))
        for target in imported_modules(path):
            if target.startswith("native_engine") and layer_of(target) not in NATIVE_LAYERS[layer]:
                violations.append(f"{module_name(path)} imports {target}")
    assert not violations, "\n".join(violations)


def test_bench_never_imports_tests() -> None:
    bad = [f"{module_name(p)} imports {t}" for p in (ROOT / "bench").rglob("*.py")
           for t in imported_modules(p) if t.split(".")[0] == "tests"]
    assert not bad, "\n".join(bad)


def import_graph(files: list[Path]) -> dict[str, set[str]]:
    graph = {module_name(p): set() for p in files}
    for p in files:
        graph[module_name(p)] = {t for t in imported_modules(p) if t in graph
                                 and t != module_name(p)}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles() -> None:
    # A package's __init__ re-exporting its modules is not a circle of concerns.
    graph = import_graph(product_files())
    for name in list(graph):
        graph[name] = {t for t in graph[name] if not name.startswith(t + ".")}
    assert circles(graph) == []


def test_circle_finder_finds_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
