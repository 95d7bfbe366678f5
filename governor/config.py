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
    `workers` governor processes share the tenant port (governor.workers; 1: this process).
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
    workers: int = 1

    @property
    def metrics_listen_port(self) -> int:
        return self.port + 1 if self.metrics_port is None else self.metrics_port


@dataclass(frozen=True, slots=True)
class UpstreamSection:
    """One `[[engine.upstreams]]` entry: a vLLM-compatible server of the fleet.

    Its `--api-key` comes from the environment variable `api_key_env` or the file
    `api_key_file`, never from the TOML. `connect_timeout_s` bounds the TCP connect,
    `read_timeout_s` the wait for the first byte (response head, first SSE event).
    `kv_events` is rank 0's PUB endpoint as the engine's --kv-events-config writes it (rank r
    on port + r, vLLM's offsets; `kv_events_mode` overrides which side binds), `kv_replay`
    rank 0's replay ROUTER. `metrics_url` is where its `/metrics` is (default: base_url).
    `data_parallel_size` ranks are addressed with `X-data-parallel-rank`.
    """

    name: str
    base_url: str
    api_key_env: str | None = None
    api_key_file: Path | None = None
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 300.0
    kv_events: str | None = None
    kv_events_mode: Literal["connect", "bind"] | None = None
    kv_topic: str = ""
    kv_replay: str | None = None
    metrics_url: str | None = None
    data_parallel_size: int = 1
    declare: CapabilityDeclaration = field(default_factory=CapabilityDeclaration)

    @classmethod
    def from_toml_dict(cls, raw: dict[str, Any]) -> UpstreamSection:
        values = dict(raw)
        values["declare"] = CapabilityDeclaration(**values.get("declare", {}))
        if "api_key_file" in values:
            values["api_key_file"] = Path(values["api_key_file"])
        return cls(**values)


@dataclass(frozen=True, slots=True)
class RoutingSection:
    """`[engine.routing]`: the policy (policies/routing.py), its weights, the tokenizer
    prompts are matched with ("embedded", a .gguf or an HF directory; none: token-id prompts
    only), how many prompt texts its token-prefix cache keeps (`tokenize_cache_entries`;
    0: every prompt tokenised whole), and how often upstreams are health-checked
    (`health_interval_s`; a failing one is retried with doubling backoff up to
    `backoff_max_s`)."""

    policy: Literal["kv_aware", "least_loaded", "round_robin"] = "kv_aware"
    tokenizer: str | None = None
    tokenize_cache_entries: int = 1024
    overlap_weight: float = 1.0
    load_weight: float = 1.0
    health_interval_s: float = 1.0
    backoff_max_s: float = 10.0


@dataclass(frozen=True, slots=True)
class EngineSection:
    """`[engine]`. `allow_remote_kv`: KV-event sockets may leave loopback (SEC-17: the
    streams carry every tenant's tokens and salts; off by default). A fleet is
    `[[engine.upstreams]]` (kind = "vllm"); the single-upstream form (`base_url`, ...)
    means one upstream."""

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
    allow_remote_kv: bool = False
    cache_control_token_env: str | None = None
    declare: CapabilityDeclaration = field(default_factory=CapabilityDeclaration)
    upstreams: tuple[UpstreamSection, ...] = ()
    routing: RoutingSection = field(default_factory=RoutingSection)


def check_upstreams(upstreams: tuple[UpstreamSection, ...]) -> None:
    """What the schema cannot say: names unique, at most one key source each."""
    names = [u.name for u in upstreams]
    if len(names) != len(set(names)):
        raise ValueError(f"[[engine.upstreams]] names must be unique: {names}")
    for u in upstreams:
        if u.api_key_env and u.api_key_file:
            raise ValueError(f"upstream {u.name}: give api_key_env or api_key_file, not both")


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
    engine_raw = raw.get("engine")
    if isinstance(engine_raw, dict) and engine_raw.get("kind") == "vllm" and not (
            {"base_url", "upstreams"} & set(engine_raw)):
        raise ConfigError('[engine] kind = "vllm" needs base_url (one upstream) or '
                          '[[engine.upstreams]] (a fleet)')
    try:
        validate("tenant_config", raw)
        engine = dict(raw.get("engine", {}))
        engine["declare"] = CapabilityDeclaration(**engine.get("declare", {}))
        engine["upstreams"] = tuple(UpstreamSection.from_toml_dict(u)
                                    for u in engine.get("upstreams", []))
        check_upstreams(engine["upstreams"])
        engine["routing"] = RoutingSection(**engine.get("routing", {}))
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
