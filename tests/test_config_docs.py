"""The complete multi-tenant config in README.md and docs/operations.md §13: the same file in
both, valid as written, and naming every key the config schema has (a commented line names a
key of another engine kind; the fleet's keys are in §12's example)."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

from governor.config import parse_config

ROOT = Path(__file__).resolve().parents[1]
MARK = "# fak.toml: three tenants"
TABLES = {"declare", "upstreams", "routing"}  # named by their [section] headers


def full_example(path: Path) -> str:
    blocks = [b for b in re.findall(r"```toml\n(.*?)```", path.read_text(), flags=re.S)
              if b.startswith(MARK)]
    assert len(blocks) == 1, f"{path.name}: one complete example expected"
    return blocks[0]


def fleet_example() -> str:
    section = (ROOT / "docs" / "operations.md").read_text().split("## 12. A fleet", 1)[1]
    return re.findall(r"```toml\n(.*?)```", section, flags=re.S)[0]


def schema_keys() -> dict[str, set[str]]:
    schema = json.loads((ROOT / "schemas" / "json" / "tenant_config.json").read_text())
    declare = json.loads((ROOT / "schemas" / "json" / "capability_declaration.json").read_text())
    defs: dict[str, Any] = schema["$defs"]
    return {name: set(defs[name]["properties"])
            for name in ("server", "engine", "audit", "state", "tenant", "upstream", "routing")
            } | {"declare": set(declare["properties"])}


def named_keys(text: str) -> set[str]:
    return set(re.findall(r"^#? ?([a-z_0-9]+) = ", text, flags=re.M))


def test_readme_and_operations_show_the_same_file() -> None:
    assert full_example(ROOT / "README.md") == full_example(ROOT / "docs" / "operations.md")


def test_the_example_is_valid_as_written() -> None:
    config = parse_config(tomllib.loads(full_example(ROOT / "README.md")))
    assert {t.id for t in config.tenants} == {"acme", "beta", "nightly"}
    assert config.engine.kind == "vllm" and config.server.metrics_token_sha256 is not None


def test_every_schema_key_is_named() -> None:
    keys = schema_keys()
    example = full_example(ROOT / "README.md")
    single = set().union(*(v for k, v in keys.items() if k not in ("upstream", "routing")))
    assert single - TABLES - named_keys(example) == set()
    assert (keys["upstream"] | keys["routing"]) - TABLES - named_keys(fleet_example()) == set()
    for section in ("[server]", "[engine]", "[engine.declare]", "[audit]", "[state]",
                    "[[tenants]]"):
        assert f"\n{section}" in example
