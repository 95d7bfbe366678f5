"""The governor's configuration: one TOML file, validated once at start-up."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from policies.priority import DEFAULT_CLASSES

HEX64 = re.compile(r"^[0-9a-f]{64}$")
TENANT_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
TENANT_CLASSES = DEFAULT_CLASSES


class ConfigError(ValueError):
    """The configuration cannot be used; the message names the key."""


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    data_dir: Path = Path("./fak-data")
    client_cache_salt: Literal["reject", "strip"] = "reject"
    admin_token_sha256: str | None = None
    max_body_bytes: int = 1 << 20
    admission_wait_s: float = 10.0
    max_engine_concurrency: int = 64
    drain_timeout_s: float = 30.0
    keepalive_s: float = 15.0


@dataclass(frozen=True, slots=True)
class Declarations:
    """Operator declarations about a ridden engine; probes confirm them at start."""

    priority_scheduling: bool = False
    prefix_reset: bool = False
    prompt_tokens_details: bool = False
    determinism: str = "unavailable"


@dataclass(frozen=True, slots=True)
class EngineSection:
    kind: Literal["native", "vllm"] = "native"
    model: str | None = None
    base_url: str | None = None
    kv_events: str | None = None
    kv_replay: str | None = None
    metrics_url: str | None = None
    max_model_len: int = 2048
    num_blocks: int | None = None
    declare: Declarations = field(default_factory=Declarations)


@dataclass(frozen=True, slots=True)
class TenantConfig:
    id: str
    api_key_sha256: tuple[str, ...]
    tenant_class: str = "standard"
    max_concurrency: int = 16
    max_tokens: int = 2048


@dataclass(frozen=True, slots=True)
class GovernorConfig:
    server: ServerConfig
    engine: EngineSection
    tenants: tuple[TenantConfig, ...]

    def tenant(self, tenant_id: str) -> TenantConfig | None:
        return next((t for t in self.tenants if t.id == tenant_id), None)


def _take(section: dict[str, Any], cls: type, where: str) -> dict[str, Any]:
    known = set(cls.__dataclass_fields__)
    unknown = set(section) - known
    if unknown:
        raise ConfigError(f"[{where}] unknown key(s): {', '.join(sorted(unknown))}")
    return dict(section)


def _server(raw: dict[str, Any]) -> ServerConfig:
    values = _take(raw, ServerConfig, "server")
    if "data_dir" in values:
        values["data_dir"] = Path(values["data_dir"])
    server = ServerConfig(**values)
    if server.client_cache_salt not in ("reject", "strip"):
        raise ConfigError('[server] client_cache_salt must be "reject" or "strip"')
    if server.admin_token_sha256 is not None and not HEX64.match(server.admin_token_sha256):
        raise ConfigError("[server] admin_token_sha256 must be 64 lowercase hex characters")
    if not 0 < server.port < 65536:
        raise ConfigError("[server] port must be 1..65535")
    return server


def _engine(raw: dict[str, Any]) -> EngineSection:
    values = _take(raw, EngineSection, "engine")
    values["declare"] = Declarations(**_take(values.get("declare", {}), Declarations,
                                             "engine.declare"))
    engine = EngineSection(**values)
    if engine.kind not in ("native", "vllm"):
        raise ConfigError('[engine] kind must be "native" or "vllm"')
    if engine.kind == "vllm" and not engine.base_url:
        raise ConfigError("[engine] kind = \"vllm\" needs base_url")
    return engine


def _tenant(raw: dict[str, Any]) -> TenantConfig:
    values = dict(raw)
    if "class" in values:
        values["tenant_class"] = values.pop("class")
    values = _take(values, TenantConfig, "tenants")
    keys = values.get("api_key_sha256", [])
    values["api_key_sha256"] = tuple([keys] if isinstance(keys, str) else keys)
    tenant = TenantConfig(**values)
    if not TENANT_ID.match(tenant.id):
        raise ConfigError(f"[[tenants]] id {tenant.id!r} must match {TENANT_ID.pattern}")
    if not tenant.api_key_sha256 or not all(HEX64.match(k) for k in tenant.api_key_sha256):
        raise ConfigError(f"[[tenants]] {tenant.id}: api_key_sha256 needs 64-hex digests")
    if tenant.tenant_class not in TENANT_CLASSES:
        raise ConfigError(f"[[tenants]] {tenant.id}: class must be one of {TENANT_CLASSES}")
    if tenant.max_concurrency < 1 or tenant.max_tokens < 1:
        raise ConfigError(f"[[tenants]] {tenant.id}: max_concurrency and max_tokens must be ≥ 1")
    return tenant


def parse_config(raw: dict[str, Any]) -> GovernorConfig:
    unknown = set(raw) - {"server", "engine", "tenants"}
    if unknown:
        raise ConfigError(f"unknown section(s): {', '.join(sorted(unknown))}")
    tenants = tuple(_tenant(t) for t in raw.get("tenants", []))
    ids = [t.id for t in tenants]
    if len(ids) != len(set(ids)):
        raise ConfigError("[[tenants]] ids must be unique")
    digests = [d for t in tenants for d in t.api_key_sha256]
    if len(digests) != len(set(digests)):
        raise ConfigError("[[tenants]] an API key digest is listed twice")
    return GovernorConfig(_server(raw.get("server", {})), _engine(raw.get("engine", {})), tenants)


def load_config(path: Path) -> GovernorConfig:
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from exc
    try:
        return parse_config(raw)
    except TypeError as exc:
        raise ConfigError(f"bad config {path}: {exc}") from exc
