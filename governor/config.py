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
    kind: Literal["native", "vllm"] = "native"
    model: str | None = None
    base_url: str | None = None
    kv_events: str | None = None
    kv_replay: str | None = None
    metrics_url: str | None = None
    max_model_len: int = 2048
    num_blocks: int | None = None
    cache_control_token_env: str | None = None
    declare: CapabilityDeclaration = field(default_factory=CapabilityDeclaration)


@dataclass(frozen=True, slots=True)
class AuditSection:
    """`[audit]`: the log's checkpoints, where its key and anchors live, and how often
    client events are summarised (governor.audit.counters)."""

    summary_interval_s: float = 60.0
    checkpoint_every_records: int = 64
    checkpoint_every_seconds: float = 60.0
    signing_key_path: Path | None = None
    anchor_dir: Path | None = None
    min_free_bytes: int = 1 << 20


@dataclass(frozen=True, slots=True)
class StateSection:
    """`[state]`: where epochs, quarantine records and the audit log live. `file` is the
    single-process default (data_dir); `postgres` shares them between replicas, with the DSN
    read from the environment variable `dsn_env` (governor.store)."""

    backend: Literal["file", "postgres"] = "file"
    dsn_env: str = "FAK_STATE_DSN"
    epoch_max_staleness_ms: int = 500
    replica_id: str | None = None


@dataclass(frozen=True, slots=True)
class GovernorConfig:
    server: ServerConfig
    engine: EngineSection
    tenants: tuple[TenantConfig, ...]
    audit: AuditSection = field(default_factory=AuditSection)
    state: StateSection = field(default_factory=StateSection)

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
        audit = dict(raw.get("audit", {}))
        for key in ("signing_key_path", "anchor_dir"):
            if key in audit:
                audit[key] = Path(audit[key])
        state = StateSection(**raw.get("state", {}))
    except (DocumentInvalid, ValueError, TypeError) as exc:
        raise ConfigError(str(exc)) from exc
    return GovernorConfig(ServerConfig(**server), EngineSection(**engine), tenants,
                          AuditSection(**audit), state)


def load_config(path: Path) -> GovernorConfig:
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from exc
    return parse_config(raw)
