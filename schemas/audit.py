"""Audit records and signed checkpoints (docs/security.md §7, SEC-12..14).

Minimisation (SEC-14) is built into the types: a span is only ever a digest and a length,
and every free-form field is an identifier or a reason *code* (lowercase, no spaces, ≤ 128
chars), so prompt text, salts, keys and token ids have no field to live in. Timestamps are
integer milliseconds: the log hashes canonical JSON, and floats have no canonical form.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from dataclasses import dataclass
from typing import Any

from schemas.values import is_int

HEX64 = re.compile(r"[0-9a-f]{64}")
HEX128 = re.compile(r"[0-9a-f]{128}")
IDENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@-]{0,127}")
CODE = re.compile(r"[a-z0-9][a-z0-9_.:=/+-]{0,127}")
KIND = re.compile(r"[a-z][a-z0-9_]{0,63}")


class AuditState(enum.StrEnum):
    """Outcome of the audited action. `recorded`: a fact with nothing to verify (a stripped
    client salt, a recovered log tail)."""

    VERIFIED = "VERIFIED"
    UNVERIFIED = "UNVERIFIED"
    FAILED = "FAILED"
    REFUSED = "REFUSED"
    RECORDED = "RECORDED"


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)



def _check_optional(name: str, value: object, pattern: re.Pattern[str]) -> None:
    if value is not None:
        _require(isinstance(value, str) and pattern.fullmatch(value) is not None,
                 f"{name} must match {pattern.pattern}, got {value!r}")


def _check_optional_count(name: str, value: object) -> None:
    if value is not None:
        _require(is_int(value) and value >= 0, f"{name} must be an int ≥ 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class SpanRef:
    """A span by reference: SHA-256 hex digest and token length. Never the tokens or text.

    Prefer a keyed digest (HMAC) for short spans: a plain hash of a guessable prompt can be
    confirmed by anyone who can read the log.
    """

    digest: str
    length: int

    def __post_init__(self) -> None:
        _require(isinstance(self.digest, str) and HEX64.fullmatch(self.digest) is not None,
                 "span digest must be 64 lowercase hex characters")
        _require(is_int(self.length) and self.length >= 0, "span length must be an int ≥ 0")


@dataclass(frozen=True, slots=True)
class Evidence:
    """The facts behind a state (SEC-11, docs/security.md §7.8), all codes or counts.

    `kv_events` summarises the KV-event evidence, e.g. `all_blocks_cleared`, `seq_gap`;
    `kv_seq_from`/`kv_seq_to` the sequence range seen after the watermark; probe fields are
    the canary's `cached_tokens` before (positive control) and after the action.
    """

    engine_result: str | None = None
    kv_events: str | None = None
    kv_seq_from: int | None = None
    kv_seq_to: int | None = None
    probe_control_cached_tokens: int | None = None
    probe_after_cached_tokens: int | None = None
    old_epoch: int | None = None
    new_epoch: int | None = None

    def __post_init__(self) -> None:
        _check_optional("engine_result", self.engine_result, CODE)
        _check_optional("kv_events", self.kv_events, CODE)
        for name in ("kv_seq_from", "kv_seq_to", "probe_control_cached_tokens",
                     "probe_after_cached_tokens", "old_epoch", "new_epoch"):
            _check_optional_count(name, getattr(self, name))


@dataclass(frozen=True, slots=True)
class AuditEvent:
    """What happened, as a caller hands it to the audit log (which adds index and time)."""

    kind: str
    actor: str
    state: AuditState
    tenant: str | None = None
    plan: str | None = None
    reasons: tuple[str, ...] = ()
    span: SpanRef | None = None
    evidence: Evidence | None = None
    request_id: str | None = None

    def __post_init__(self) -> None:
        _require(isinstance(self.kind, str) and KIND.fullmatch(self.kind) is not None,
                 f"kind must match {KIND.pattern}, got {self.kind!r}")
        _require(isinstance(self.actor, str) and IDENT.fullmatch(self.actor) is not None,
                 f"actor must match {IDENT.pattern}, got {self.actor!r}")
        _require(isinstance(self.state, AuditState), "state must be an AuditState")
        _check_optional("tenant", self.tenant, IDENT)
        _check_optional("plan", self.plan, CODE)
        _check_optional("request_id", self.request_id, IDENT)
        _require(isinstance(self.reasons, tuple), "reasons must be a tuple of codes")
        for reason in self.reasons:
            _check_optional("reason", reason, CODE)
        _require(self.span is None or isinstance(self.span, SpanRef), "span must be a SpanRef")
        _require(self.evidence is None or isinstance(self.evidence, Evidence),
                 "evidence must be an Evidence")


@dataclass(frozen=True, slots=True)
class AuditRecord:
    """One committed entry: its position in the log, Unix time in ms, and the event."""

    index: int
    time_ms: int
    event: AuditEvent

    def __post_init__(self) -> None:
        _require(is_int(self.index) and self.index >= 0, "index must be an int ≥ 0")
        _require(is_int(self.time_ms) and self.time_ms >= 0, "time_ms must be an int ≥ 0")
        _require(isinstance(self.event, AuditEvent), "event must be an AuditEvent")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> AuditRecord:
        """Strict inverse of `dataclasses.asdict`: exact keys, checked values."""
        _exact_keys(raw, ("index", "time_ms", "event"), "record")
        ev = raw["event"]
        _exact_keys(ev, _field_names(AuditEvent), "event")
        span, evidence = ev["span"], ev["evidence"]
        if span is not None:
            _exact_keys(span, ("digest", "length"), "span")
        if evidence is not None:
            _exact_keys(evidence, _field_names(Evidence), "evidence")
        _require(isinstance(ev["reasons"], list), "reasons must be a list")
        _require(ev["state"] in AuditState.__members__.values(), f"bad state {ev['state']!r}")
        event = AuditEvent(
            **{**ev, "state": AuditState(ev["state"]), "reasons": tuple(ev["reasons"]),
               "span": None if span is None else SpanRef(**span),
               "evidence": None if evidence is None else Evidence(**evidence)}
        )
        return cls(index=raw["index"], time_ms=raw["time_ms"], event=event)


@dataclass(frozen=True, slots=True)
class SignedCheckpoint:
    """A signed tree head: the log's first `tree_size` records hash to `root_hash`.

    `key_id` is the SHA-256 hex of the raw Ed25519 `public_key`; `signature` (hex) covers
    tree_size, root_hash, timestamp_ms and key_id (the message format is the log's).
    """

    tree_size: int
    root_hash: str
    timestamp_ms: int
    key_id: str
    public_key: str
    signature: str

    def __post_init__(self) -> None:
        _require(is_int(self.tree_size) and self.tree_size >= 0, "tree_size must be ≥ 0")
        _require(is_int(self.timestamp_ms) and self.timestamp_ms >= 0,
                 "timestamp_ms must be an int ≥ 0")
        for name in ("root_hash", "key_id", "public_key"):
            value = getattr(self, name)
            _require(isinstance(value, str) and HEX64.fullmatch(value) is not None,
                     f"{name} must be 64 lowercase hex characters")
        _require(isinstance(self.signature, str) and HEX128.fullmatch(self.signature) is not None,
                 "signature must be 128 lowercase hex characters")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SignedCheckpoint:
        _exact_keys(raw, _field_names(cls), "checkpoint")
        return cls(**raw)


def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def _exact_keys(raw: Any, names: tuple[str, ...], what: str) -> None:
    _require(isinstance(raw, dict), f"{what} must be an object")
    missing, extra = set(names) - set(raw), set(raw) - set(names)
    _require(not missing and not extra,
             f"{what}: missing {sorted(missing)}, unexpected {sorted(extra)}")
