"""The governor's configuration: one TOML file, validated once at start-up."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from schemas.tenants import CapabilityDeclaration, TenantConfig, check_tenants_unique
from schemas.validate import DocumentInvalid, validate


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
class EngineSection:
    kind: Literal["native", "vllm"] = "native"
    model: str | None = None
    base_url: str | None = None
    kv_events: str | None = None
    kv_replay: str | None = None
    metrics_url: str | None = None
    max_model_len: int = 2048
    num_blocks: int | None = None
    kv_offloading_size: float | None = None
    kv_disk_dir: str | None = None
    kv_disk_size: float | None = None
    declare: CapabilityDeclaration = field(default_factory=CapabilityDeclaration)


@dataclass(frozen=True, slots=True)
class GovernorConfig:
    server: ServerConfig
    engine: EngineSection
    tenants: tuple[TenantConfig, ...]

    def tenant(self, tenant_id: str) -> TenantConfig | None:
        return next((t for t in self.tenants if t.id == tenant_id), None)


def parse_config(raw: dict[str, Any]) -> GovernorConfig:
    """Validate the document against schemas/json/tenant_config.json, then build records."""
    try:
        validate("tenant_config", raw)
        engine = dict(raw.get("engine", {}))
        engine["declare"] = CapabilityDeclaration(**engine.get("declare", {}))
        server = dict(raw.get("server", {}))
        if "data_dir" in server:
            server["data_dir"] = Path(server["data_dir"])
        tenants = tuple(TenantConfig.from_toml_dict(t) for t in raw.get("tenants", []))
        check_tenants_unique(tenants)
    except (DocumentInvalid, ValueError, TypeError) as exc:
        raise ConfigError(str(exc)) from exc
    return GovernorConfig(ServerConfig(**server), EngineSection(**engine), tenants)


def load_config(path: Path) -> GovernorConfig:
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from exc
    return parse_config(raw)
