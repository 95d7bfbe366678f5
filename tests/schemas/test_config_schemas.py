"""Tenant config, capability declaration and engine capabilities: records and JSON Schemas."""

from __future__ import annotations

import copy
import dataclasses
import tomllib

import pytest

from governor.config import ConfigError, EngineSection, ServerConfig, parse_config
from policies.priority import DEFAULT_CLASSES
from schemas.engine import Determinism, EngineCapabilities, PriorityDirection
from schemas.tenants import (
    TENANT_CLASSES,
    CapabilityDeclaration,
    TenantConfig,
    check_tenants_unique,
)
from schemas.validate import errors, load_schema, validate

KEY = "b" * 64
ADMIN = "a" * 64

ISSUE_EXAMPLE = f"""
[server]
host = "127.0.0.1"
port = 8000
data_dir = "./fak-data"
client_cache_salt = "reject"
admin_token_sha256 = "{ADMIN}"

[engine]
kind = "native"
model = "/models/smollm2.gguf"

[engine.declare]
priority_scheduling = false
prefix_reset = false
prompt_tokens_details = false
determinism = "unavailable"

[[tenants]]
id = "acme"
api_key_sha256 = ["{KEY}"]
class = "interactive"
max_concurrency = 16
max_tokens = 2048
"""

VLLM_EXAMPLE = f"""
[server]
client_cache_salt = "strip"
admin_token_sha256 = "{ADMIN}"
max_body_bytes = 1048576
admission_wait_s = 2.5

[engine]
kind = "vllm"
base_url = "http://127.0.0.1:8001"
model = "HuggingFaceTB/SmolLM2-135M-Instruct"
kv_events = "tcp://127.0.0.1:5557"
kv_replay = "tcp://127.0.0.1:5558"
metrics_url = "http://127.0.0.1:8001/metrics"

[engine.declare]
priority_scheduling = true
prefix_reset = true
prompt_tokens_details = true
determinism = "batch_invariant"

[[tenants]]
id = "acme"
api_key_sha256 = ["{KEY}", "{"c" * 64}"]
class = "interactive"

[[tenants]]
id = "beta.team-2"
api_key_sha256 = ["{"d" * 64}"]
class = "batch"
max_concurrency = 2
max_tokens = 512
"""


@pytest.mark.parametrize("text", [ISSUE_EXAMPLE, VLLM_EXAMPLE])
def test_real_configs_validate_and_load(text: str) -> None:
    raw = tomllib.loads(text)
    validate("tenant_config", raw)
    loaded = parse_config(raw)  # the governor's loader accepts the same document
    tenants = [TenantConfig.from_toml_dict(t) for t in raw["tenants"]]
    check_tenants_unique(tenants)
    for mine, theirs in zip(tenants, loaded.tenants, strict=True):
        assert dataclasses.astuple(mine) == dataclasses.astuple(theirs)
        assert mine.to_toml_dict() == {**{"class": "standard", "max_concurrency": 16},
                                       **_raw_tenant(raw, mine.id)}
    declare = CapabilityDeclaration(**raw["engine"]["declare"])
    validate("capability_declaration", declare)
    assert dataclasses.astuple(declare) == dataclasses.astuple(loaded.engine.declare)


def _raw_tenant(raw: dict, tenant_id: str) -> dict:
    return next(t for t in raw["tenants"] if t["id"] == tenant_id)


def test_tenant_built_from_dataclass_validates() -> None:
    tenant = TenantConfig("acme", (KEY,), "background", 4, 128)
    validate("tenant_config", {"tenants": [tenant.to_toml_dict()]})
    assert TenantConfig.from_toml_dict(tenant.to_toml_dict()) == tenant


def _mutated(mutate) -> dict:
    raw = copy.deepcopy(tomllib.loads(ISSUE_EXAMPLE))
    mutate(raw)
    return raw


# Each broken document is rejected by the schema and by the governor's loader.
BROKEN = {
    "salt policy": lambda r: r["server"].update(client_cache_salt="allow"),
    "admin digest": lambda r: r["server"].update(admin_token_sha256="xyz"),
    "uppercase digest": lambda r: r["server"].update(admin_token_sha256=ADMIN.upper()),
    "port zero": lambda r: r["server"].update(port=0),
    "unknown server key": lambda r: r["server"].update(bogus=1),
    "engine kind": lambda r: r["engine"].update(kind="tgi"),
    "vllm without base_url": lambda r: r["engine"].update(kind="vllm"),
    "unknown declaration": lambda r: r["engine"]["declare"].update(speed=True),
    "declaration type": lambda r: r["engine"]["declare"].update(prefix_reset="yes"),
    "no key digests": lambda r: r["tenants"][0].update(api_key_sha256=[]),
    "bad key digest": lambda r: r["tenants"][0].update(api_key_sha256=["k" * 64]),
    "tenant id": lambda r: r["tenants"][0].update(id="a b"),
    "tenant class": lambda r: r["tenants"][0].update({"class": "vip"}),
    "zero concurrency": lambda r: r["tenants"][0].update(max_concurrency=0),
    "tenant extra key": lambda r: r["tenants"][0].update(api_key="plaintext"),
    "missing id": lambda r: r["tenants"][0].pop("id"),
    "extra section": lambda r: r.update(extra={}),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_configs_are_rejected_by_the_schema(name: str) -> None:
    raw = _mutated(BROKEN[name])
    assert errors("tenant_config", raw), name


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_configs_are_rejected_by_the_loader(name: str) -> None:
    with pytest.raises((ConfigError, TypeError, ValueError)):
        parse_config(_mutated(BROKEN[name]))


def test_uniqueness_is_checked_outside_the_schema() -> None:
    a = TenantConfig("a", (KEY,))
    with pytest.raises(ValueError, match="unique"):
        check_tenants_unique([a, TenantConfig("a", ("c" * 64,))])
    with pytest.raises(ValueError, match="twice"):
        check_tenants_unique([a, TenantConfig("b", (KEY,))])


def test_tenant_dataclass_refuses_bad_values() -> None:
    for bad in (
        lambda: TenantConfig("a b", (KEY,)),
        lambda: TenantConfig("a", ()),
        lambda: TenantConfig("a", [KEY]),  # type: ignore[arg-type]
        lambda: TenantConfig("a", (KEY,), "vip"),
        lambda: TenantConfig("a", (KEY,), max_tokens=0),
        lambda: TenantConfig("a", (KEY,), max_concurrency=True),  # type: ignore[arg-type]
        lambda: TenantConfig.from_toml_dict({"id": "a", "api_key_sha256": [KEY], "x": 1}),
        lambda: CapabilityDeclaration(prefix_reset="yes"),  # type: ignore[arg-type]
    ):
        with pytest.raises(ValueError):
            bad()


def test_classes_and_declarations_match_the_policies_and_loader() -> None:
    assert TENANT_CLASSES == DEFAULT_CLASSES
    tenant_schema = load_schema("tenant_config")["$defs"]["tenant"]
    assert tuple(tenant_schema["properties"]["class"]["enum"]) == DEFAULT_CLASSES
    declared = {f.name for f in dataclasses.fields(CapabilityDeclaration)}
    defs = load_schema("tenant_config")["$defs"]
    for record, section in ((ServerConfig, "server"), (EngineSection, "engine")):
        assert {f.name for f in dataclasses.fields(record)} == set(defs[section]["properties"])
    assert declared == set(load_schema("capability_declaration")["properties"])


def test_unknown_determinism_text_is_left_to_the_policy() -> None:
    validate("capability_declaration", CapabilityDeclaration(determinism="Batch-Invariant?"))
    assert errors("capability_declaration", {"determinism": 1})


def test_engine_capabilities_validate() -> None:
    native = EngineCapabilities(
        engine_kind="native", model_id="smollm2-135m", max_model_len=2048, block_size=16,
        cache_salt=True, priority_scheduling=True, exact_span_evict=True, prefix_reset=True,
        kv_events=True, kv_replay=True, cached_tokens_in_usage=True,
        determinism=Determinism.BATCH_INVARIANT, notes=("greedy fp32 torch path",))
    ridden = EngineCapabilities(engine_kind="vllm", model_id="m",
                                priority_direction=PriorityDirection.LOWER_IS_SOONER)
    for caps in (native, ridden):
        validate("engine_capabilities", caps)
    schema = load_schema("engine_capabilities")
    assert set(schema["properties"]) == {f.name for f in dataclasses.fields(EngineCapabilities)}
    assert errors("engine_capabilities", {"engine_kind": "tgi", "model_id": "m"})
    assert errors("engine_capabilities", {"engine_kind": "vllm", "model_id": "m",
                                          "determinism": "maybe"})
    assert errors("engine_capabilities", {"engine_kind": "vllm", "model_id": "m",
                                          "block_size": 0})
    assert errors("engine_capabilities", {"engine_kind": "vllm"})
    assert errors("engine_capabilities", {"engine_kind": "vllm", "model_id": "m", "x": 1})
