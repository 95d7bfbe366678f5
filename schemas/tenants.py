"""Tenant configuration and operator capability declarations (the governor's TOML contract).

The TOML key for a tenant's class is `class` (a Python keyword), hence `tenant_class` here
and `to_toml_dict` / `from_toml_dict` for the document form that `schemas/json/
tenant_config.json` describes. Determinism stays the operator's text: the policy parses it
and anything it does not know means `unavailable` (docs/design.md §3).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from schemas.values import is_int

HEX64 = re.compile(r"[0-9a-f]{64}")
TENANT_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")
TENANT_CLASSES = ("interactive", "standard", "batch", "background")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _positive_int(value: object) -> bool:
    return is_int(value) and value >= 1


@dataclass(frozen=True, slots=True)
class TenantConfig:
    """One `[[tenants]]` entry. Keys are stored only as SHA-256 hex digests.

    `max_tokens` None takes the server's default cap; `max_queued` None allows as many
    waiters as `max_concurrency`; `allow` names the feature groups the operator enables for
    this tenant (policies.request_fields); `media_url_allowlist` holds URL prefixes media
    parts may point at; `requests_per_s` / `tokens_per_min` are token-bucket rate limits
    (None: none); `cache_share` reserves that fraction of the native engine's KV blocks for
    the tenant's cached prefixes (SEC-9; a ridden engine offers no such isolation).
    """

    id: str
    api_key_sha256: tuple[str, ...]
    tenant_class: str = "standard"
    max_concurrency: int = 16
    max_tokens: int | None = None
    max_queued: int | None = None
    allow: tuple[str, ...] = ()
    media_url_allowlist: tuple[str, ...] = ()
    requests_per_s: float | None = None
    tokens_per_min: int | None = None
    cache_share: float | None = None

    def __post_init__(self) -> None:
        _require(isinstance(self.id, str) and TENANT_ID.fullmatch(self.id) is not None,
                 f"tenant id must match {TENANT_ID.pattern}, got {self.id!r}")
        _require(isinstance(self.api_key_sha256, tuple) and len(self.api_key_sha256) > 0,
                 f"tenant {self.id}: api_key_sha256 must be a non-empty tuple of digests")
        for digest in self.api_key_sha256:
            _require(isinstance(digest, str) and HEX64.fullmatch(digest) is not None,
                     f"tenant {self.id}: api_key_sha256 entries must be 64 lowercase hex")
        _require(self.tenant_class in TENANT_CLASSES,
                 f"tenant {self.id}: class must be one of {TENANT_CLASSES}")
        _require(_positive_int(self.max_concurrency),
                 f"tenant {self.id}: max_concurrency must be an int ≥ 1")
        for name in ("max_tokens", "max_queued", "tokens_per_min"):
            value = getattr(self, name)
            _require(value is None or _positive_int(value),
                     f"tenant {self.id}: {name} must be an int ≥ 1")
        _require(self.requests_per_s is None or (
            isinstance(self.requests_per_s, int | float) and not isinstance(
                self.requests_per_s, bool) and 0 < self.requests_per_s < float("inf")),
                 f"tenant {self.id}: requests_per_s must be a positive number")
        _require(self.cache_share is None or (
            isinstance(self.cache_share, int | float) and not isinstance(self.cache_share, bool)
            and 0 < self.cache_share <= 1),
                 f"tenant {self.id}: cache_share must be a fraction in (0, 1]")
        for name in ("allow", "media_url_allowlist"):
            value = getattr(self, name)
            _require(isinstance(value, tuple) and all(isinstance(v, str) and v for v in value),
                     f"tenant {self.id}: {name} must be a list of non-empty strings")
        _require(all(u.startswith("https://") for u in self.media_url_allowlist),
                 f"tenant {self.id}: media_url_allowlist entries must be https:// prefixes")

    @property
    def queue_limit(self) -> int:
        return self.max_queued if self.max_queued is not None else self.max_concurrency

    def to_toml_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"id": self.id, "api_key_sha256": list(self.api_key_sha256),
                               "class": self.tenant_class,
                               "max_concurrency": self.max_concurrency}
        for name in ("max_tokens", "max_queued", "requests_per_s", "tokens_per_min",
                     "cache_share"):
            if getattr(self, name) is not None:
                doc[name] = getattr(self, name)
        for name in ("allow", "media_url_allowlist"):
            if getattr(self, name):
                doc[name] = list(getattr(self, name))
        return doc

    @classmethod
    def from_toml_dict(cls, raw: dict[str, Any]) -> TenantConfig:
        known = {"id", "api_key_sha256", "class", "max_concurrency", "max_tokens",
                 "max_queued", "allow", "media_url_allowlist", "requests_per_s",
                 "tokens_per_min", "cache_share"}
        unknown = set(raw) - known
        _require(not unknown, f"[[tenants]] unknown key(s): {sorted(unknown)}")
        values = {("tenant_class" if k == "class" else k): v for k, v in raw.items()}
        for name in ("api_key_sha256", "allow", "media_url_allowlist"):
            if isinstance(values.get(name), list):
                values[name] = tuple(values[name])
        return cls(**values)


def check_tenants_unique(tenants: Iterable[TenantConfig]) -> None:
    """What JSON Schema cannot say: ids unique, and no key digest shared by two entries."""
    tenants = list(tenants)
    ids = [t.id for t in tenants]
    _require(len(ids) == len(set(ids)), "tenant ids must be unique")
    digests = [d for t in tenants for d in t.api_key_sha256]
    _require(len(digests) == len(set(digests)), "an API key digest is listed twice")
    _require(sum(t.cache_share or 0 for t in tenants) <= 1,
             "the tenants' cache_share values add up to more than the whole KV pool")


@dataclass(frozen=True, slots=True)
class CapabilityDeclaration:
    """`[engine.declare]`: what the operator says a ridden engine was started with. Each
    claim is probed at start-up; a declared capability that fails its probe is refused."""

    priority_scheduling: bool = False
    prefix_reset: bool = False
    prompt_tokens_details: bool = False
    determinism: str = "unavailable"

    def __post_init__(self) -> None:
        for name in ("priority_scheduling", "prefix_reset", "prompt_tokens_details"):
            _require(isinstance(getattr(self, name), bool), f"{name} must be true or false")
        _require(isinstance(self.determinism, str), "determinism must be a string")
