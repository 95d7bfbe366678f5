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
    """`[server]`. Timeouts bound every phase a client controls: the request head
    (`header_timeout_s`), the body (`body_timeout_s`, else 408), an idle keep-alive
    connection (`keepalive_timeout_s`); `max_connections_per_peer` caps one address's open
    connections. Admission waits at most `admission_wait_s`, with at most `max_queued`
    waiters in all. `/metrics` is served on its own listener (`metrics_host`,
    `metrics_port`, None: `port + 1`), and on the tenant port only to `metrics_token_sha256`.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    data_dir: Path = Path("./fak-data")
    client_cache_salt: Literal["reject", "strip"] = "reject"
    admin_token_sha256: str | None = None
    max_body_bytes: int = 1 << 20
    admission_wait_s: float = 10.0
    max_engine_concurrency: int = 64
    max_queued: int = 256
    drain_timeout_s: float = 30.0
    keepalive_s: float = 15.0
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keepalive_timeout_s: float = 75.0
    max_connections_per_peer: int = 256
    unknown_fields: Literal["reject", "drop"] = "reject"
    default_max_tokens: int = 2048
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None
    metrics_token_sha256: str | None = None
    metrics_refresh_s: float = 5.0

    @property
    def metrics_listen_port(self) -> int:
        return self.port + 1 if self.metrics_port is None else self.metrics_port


@dataclass(frozen=True, slots=True)
class EngineSection:
    """`[engine]`. `allow_remote_kv`: KV-event sockets may leave loopback (SEC-17: the
    streams carry every tenant's tokens and salts; off by default)."""

    kind: Literal["native", "vllm"] = "native"
    model: str | None = None
    base_url: str | None = None
    kv_events: str | None = None
    kv_replay: str | None = None
    metrics_url: str | None = None
    max_model_len: int = 2048
    num_blocks: int | None = None
    allow_remote_kv: bool = False
    cache_control_token_env: str | None = None
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
