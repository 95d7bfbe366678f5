"""Validate documents against the JSON Schema files in `schemas/json/` (draft 2020-12).

Schemas refer to each other by `$id` (`urn:fak:schema:<name>`) through one registry, so a
file can be read alone and still resolve its references. Dataclass records are validated
as the JSON they become: `document()` turns tuples into lists and enums into strings.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match
from referencing import Registry, Resource

SCHEMA_DIR = Path(__file__).resolve().parent / "json"
SCHEMA_NAMES = (
    "ab_artifact",
    "audit_log_entry",
    "audit_record",
    "capability_declaration",
    "checkpoint",
    "engine_capabilities",
    "tenant_config",
)


class DocumentInvalid(ValueError):
    """A document broke its schema; `errors` lists every violation as `path: message`."""

    def __init__(self, schema: str, errors: list[str]) -> None:
        super().__init__(f"invalid {schema} document:\n  " + "\n  ".join(errors))
        self.schema = schema
        self.errors = errors


@functools.cache
def load_schema(name: str) -> dict[str, Any]:
    if name not in SCHEMA_NAMES:
        raise KeyError(f"unknown schema {name!r}; known: {', '.join(SCHEMA_NAMES)}")
    schema: dict[str, Any] = json.loads((SCHEMA_DIR / f"{name}.json").read_text())
    Draft202012Validator.check_schema(schema)
    return schema


@functools.cache
def _registry() -> Registry:
    resources = [(load_schema(n)["$id"], Resource.from_contents(load_schema(n)))
                 for n in SCHEMA_NAMES]
    return Registry().with_resources(resources)


@functools.cache
def validator(name: str) -> Draft202012Validator:
    return Draft202012Validator(load_schema(name), registry=_registry())


def document(obj: Any) -> Any:
    """The JSON value of `obj` (a dataclass instance, or plain JSON-able data)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = dataclasses.asdict(obj)
    return json.loads(json.dumps(obj))


def errors(name: str, doc: Any) -> list[str]:
    """Every violation as `path: message`; for anyOf/oneOf, the most relevant branch's."""
    found = [best_match([e]) for e in validator(name).iter_errors(document(doc))]
    found.sort(key=lambda e: [str(p) for p in e.absolute_path])
    return [f"{'/'.join(str(p) for p in e.absolute_path) or '(root)'}: {e.message}"
            for e in found]


def validate(name: str, doc: Any) -> None:
    """Raise DocumentInvalid listing every violation of schema `name`."""
    problems = errors(name, doc)
    if problems:
        raise DocumentInvalid(name, problems)
