"""The operator's audited cache quarantine: plan → execute → verify → audit (docs/design.md §5).

`QuarantineService.quarantine` takes a `QuarantineRequest` (tenant, span as text, chat
messages or token ids, `start`, an operator reason code, `require_exact`), plans it with
`policies.quarantine`, runs the plan (`governor.quarantine.executors`), turns the observed facts
into a state with `verdict`, appends one `quarantine` record to the audit log and keeps the
record in memory for `get`. Refused plans are audited too.

States (SEC-11): VERIFIED only when all three facts hold — the engine reported success (for
an exact cut: its own cache checks found nothing wrong), the KV-event evidence after the
recorded watermark is complete with no lost batch (exact: the span's `BlockRemoved` set;
flush: an `AllBlocksCleared`; rotation: a new salt), and the probe's positive control hit
while the after-probe did not. A contradicted fact is
FAILED; a missing one is UNVERIFIED; `refuse` plans are REFUSED.

Minimisation (SEC-14): the record holds the span only as `SpanRef(HMAC digest, length)`.
The HMAC key is derived from the governor's salt key, so a guessable prompt cannot be
confirmed from the log without the key. The operator's reason must be a code, not prose.
Quarantines run one at a time (an asyncio lock; never an engine lock).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import struct
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from adapters.driver import Fleet
from governor.quarantine.executors import (
    Facts,
    Probe,
    QuarantineConfig,
    exact_span,
    flush,
    rotate_salt,
)
from governor.quarantine.fleet import combine, fleet_flush, fleet_rotation
from governor.state import Governor
from policies.quarantine import PlanKind, QuarantinePlan, QuarantineSpan, plan_quarantine
from policies.salts import SaltKey, frame
from schemas.audit import CODE, AuditEvent, AuditState, Evidence, SpanRef
from schemas.cache_control import SpanSpec
from schemas.engine import APIError
from schemas.values import is_int

log = logging.getLogger("fak.quarantine")

SPAN_DIGEST_DOMAIN = b"fak-span-digest-v1"
REQUEST_KEYS = frozenset({"tenant", "span", "start", "reason", "require_exact"})
SPAN_FORMS = ("text", "messages", "token_ids")
MAX_REASON_CHARS = 100


class QuarantineRequestError(ValueError):
    """A request the service cannot take; `param` names the offending field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class UnknownTenantError(KeyError):
    """The request names a tenant the governor does not serve."""


# --- the request ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SpanInput:
    """Exactly one of: `text` (a completions prompt), `messages` (chat messages, rendered with
    the generation prompt as a chat request would be), `token_ids`."""

    text: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        given = [name for name in SPAN_FORMS if getattr(self, name) is not None]
        if len(given) != 1:
            raise QuarantineRequestError(
                f"span needs exactly one of {', '.join(SPAN_FORMS)}; got {given or 'none'}",
                "span")
        if self.text is not None and (not isinstance(self.text, str) or not self.text):
            raise QuarantineRequestError("span.text must be a non-empty string", "span.text")
        if self.messages is not None and (
                not self.messages or not all(isinstance(m, dict) for m in self.messages)):
            raise QuarantineRequestError("span.messages must be a non-empty list of message "
                                         "objects", "span.messages")
        if self.token_ids is not None and (not self.token_ids or not all(
                is_int(t) and t >= 0 for t in self.token_ids)):
            raise QuarantineRequestError("span.token_ids must be a non-empty list of ints >= 0",
                                         "span.token_ids")

    @property
    def form(self) -> str:
        return next(name for name in SPAN_FORMS if getattr(self, name) is not None)

    def spec(self) -> SpanSpec:
        return SpanSpec(self.text, self.messages, self.token_ids)

    def probe(self) -> Probe:
        """The span as a request a ridden engine caches exactly as a tenant's would."""
        if self.messages is not None:
            return Probe("chat", {"messages": [dict(m) for m in self.messages]})
        prompt: Any = self.text if self.text is not None else list(self.token_ids or ())
        return Probe("completions", {"prompt": prompt})


@dataclass(frozen=True, slots=True)
class QuarantineRequest:
    tenant: str
    span: SpanInput
    reason: str
    start: int = 0
    require_exact: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.tenant, str) or not self.tenant:
            raise QuarantineRequestError("tenant must be a non-empty string", "tenant")
        if not isinstance(self.reason, str) or len(self.reason) > MAX_REASON_CHARS \
                or CODE.fullmatch(self.reason) is None:
            raise QuarantineRequestError(
                f"reason must be a code of at most {MAX_REASON_CHARS} characters matching "
                f"{CODE.pattern} (no prose: the audit log keeps no free text)", "reason")
        if not is_int(self.start) or self.start < 0:
            raise QuarantineRequestError("start must be an int >= 0 (a token offset)", "start")
        tokens = self.span.token_ids if isinstance(self.span, SpanInput) else None
        if tokens is not None and self.start >= len(tokens):
            raise QuarantineRequestError(f"start {self.start} is not inside the span's "
                                         f"{len(tokens)} tokens", "start")
        if not isinstance(self.require_exact, bool):
            raise QuarantineRequestError("require_exact must be a boolean", "require_exact")

    @classmethod
    def from_json(cls, raw: Any) -> QuarantineRequest:
        """From the POST body: `{tenant, span: {text | messages | token_ids}, start?, reason,
        require_exact?}`; unknown keys are refused."""
        if not isinstance(raw, dict):
            raise QuarantineRequestError("the body must be a JSON object", "body")
        unknown = sorted(set(raw) - REQUEST_KEYS)
        if unknown:
            raise QuarantineRequestError(f"unknown keys {unknown}; allowed: "
                                         f"{sorted(REQUEST_KEYS)}", unknown[0])
        for key in ("tenant", "span", "reason"):
            if key not in raw:
                raise QuarantineRequestError(f"'{key}' is required", key)
        span = raw["span"]
        if not isinstance(span, dict) or set(span) - set(SPAN_FORMS):
            raise QuarantineRequestError(f"span must be an object with one of {SPAN_FORMS}",
                                         "span")
        messages, token_ids = span.get("messages"), span.get("token_ids")
        for name, value in (("messages", messages), ("token_ids", token_ids)):
            if value is not None and not isinstance(value, list):
                raise QuarantineRequestError(f"span.{name} must be a list", f"span.{name}")
        return cls(
            tenant=raw["tenant"],
            span=SpanInput(text=span.get("text"),
                           messages=None if messages is None else tuple(messages),
                           token_ids=None if token_ids is None else tuple(token_ids)),
            reason=raw["reason"],
            start=raw.get("start", 0),
            require_exact=raw.get("require_exact", False),
        )



# --- span digests ---------------------------------------------------------------------------


def span_digest_key(salt_key: SaltKey) -> bytes:
    """A key of its own for span digests, derived from the salt key (never the salt key)."""
    return hmac.new(salt_key.secret, frame(SPAN_DIGEST_DOMAIN), hashlib.sha256).digest()


def span_digest(salt_key: SaltKey, tenant: str, form: str, payload: bytes) -> str:
    """HMAC-SHA256(derived key, frame(form) ‖ frame(tenant) ‖ frame(payload)), hex."""
    message = b"".join(frame(part) for part in (form.encode(), tenant.encode(), payload))
    return hmac.new(span_digest_key(salt_key), message, hashlib.sha256).hexdigest()


def token_payload(tokens: Sequence[int]) -> bytes:
    return struct.pack(f">{len(tokens)}Q", *tokens)


def input_payload(span: SpanInput) -> bytes:
    if span.token_ids is not None:
        return token_payload(span.token_ids)
    if span.text is not None:
        return span.text.encode()
    return json.dumps(span.messages, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=False).encode()


# --- the verdict ----------------------------------------------------------------------------


def verdict(facts: Facts) -> tuple[AuditState, tuple[str, ...]]:
    """SEC-11: VERIFIED only with all three facts; a contradicted fact is FAILED, a missing
    one UNVERIFIED. Returns the state and the deciding reason codes (a fleet's: what its
    members' verdicts combine to)."""
    if facts.decided is not None:
        return facts.decided
    failed = []
    if facts.engine_ok is False:
        failed.append(f"engine:{facts.engine_result}")
    if facts.removal_ok is False:
        failed.append(f"removal:{facts.removal}")
    if facts.probe_after is not None and facts.probe_after > facts.threshold:
        failed.append("probe_hit_after")
    if failed:
        return AuditState.FAILED, tuple(failed)
    missing = []
    if facts.engine_ok is None:
        missing.append(f"engine_unconfirmed:{facts.engine_result}")
    if facts.removal_ok is None:
        missing.append(f"removal_unconfirmed:{facts.removal}")
    if facts.probe_control is None or facts.probe_after is None:
        missing.append("probe_unavailable")
    elif facts.probe_control <= facts.threshold:
        missing.append("probe_control_miss")
    if missing:
        return AuditState.UNVERIFIED, tuple(missing)
    return AuditState.VERIFIED, ("engine_ok", "removal_evidence_ok", "probe_control_hit_after_miss")


# --- records --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class QuarantineRecord:
    """One quarantine as answered and kept for GET; `audit_index` is its audit log entry."""

    id: str
    tenant: str
    plan: str
    degraded: bool
    state: AuditState
    reasons: tuple[str, ...]
    span: SpanRef
    start: int
    evidence: Evidence
    audit_index: int
    started_ms: int
    finished_ms: int

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["state"] = self.state.value
        doc["reasons"] = list(self.reasons)
        return doc


# --- the service ----------------------------------------------------------------------------


class QuarantineService:
    """Invariants (`check_integrity`): every kept record is under its own id, at most
    `max_records` are kept, each points into the audit log, and a VERIFIED one carries all
    three facts."""

    def __init__(self, gov: Governor, config: QuarantineConfig | None = None) -> None:
        self.gov = gov
        self.config = config or QuarantineConfig()
        self._records: OrderedDict[str, QuarantineRecord] = OrderedDict()
        self._lock = asyncio.Lock()

    def get(self, quarantine_id: str) -> QuarantineRecord | None:
        """A record this replica made and still keeps in memory."""
        return self._records.get(quarantine_id)

    async def lookup(self, quarantine_id: str) -> dict[str, Any] | None:
        """The record as JSON: from memory, else (postgres) from the shared store, so any
        replica answers for any replica's quarantine."""
        record = self.get(quarantine_id)
        if record is not None:
            return record.to_json()
        store = self.gov.quarantine_store
        return None if store is None else await store.get(quarantine_id)

    async def quarantine(self, request: QuarantineRequest,
                         actor: str = "admin-api") -> QuarantineRecord:
        """Plan, execute, verify, audit. Raises UnknownTenantError, QuarantineRequestError
        (span unusable on this engine), or APIError: the engine's 4xx for a span it
        cannot tokenise, 503 when the audit log cannot be written (nothing is answered
        unaudited)."""
        if self.gov.config.tenant(request.tenant) is None:
            raise UnknownTenantError(request.tenant)
        async with self._lock:
            started = _now_ms()
            # The plan does not depend on the length: the engine measures it (exact span),
            # the probe reports it, or the record says it is unmeasured.
            length = len(request.span.token_ids) if request.span.token_ids else 1
            plan = plan_quarantine(QuarantineSpan(request.tenant, length),
                                   self.gov.driver.capabilities, request.require_exact)
            facts = await self._execute(plan, request, actor)
            return await self._commit(request, plan, facts, actor, started)

    async def _execute(self, plan: QuarantinePlan, request: QuarantineRequest,
                       actor: str) -> Facts | None:
        """The plan's facts; None for a refused plan."""
        tenant, salt = request.tenant, self.gov.salt_for(request.tenant)
        control, caps = self.gov.driver.cache_control, self.gov.driver.capabilities
        probe = request.span.probe()
        driver = self.gov.driver
        try:
            if isinstance(driver, Fleet) and plan.kind is not PlanKind.REFUSE:
                return await self._execute_fleet(driver, plan, request, actor, probe)
            if plan.kind is PlanKind.EXACT:
                return await exact_span(control, caps, tenant, salt, request.span.spec(),
                                        request.start, probe, self.config)
            if plan.kind is PlanKind.WHOLE_PREFIX_FLUSH:
                return await flush(control, caps, tenant, salt, probe, self.config)
            if plan.kind is PlanKind.SALT_ROTATION:
                return await rotate_salt(self.gov, control, caps, tenant, actor, probe,
                                         self.config)
            return None
        except ValueError as exc:  # the engine cannot take this span (e.g. start past end)
            raise QuarantineRequestError(str(exc), "span") from None
        except APIError:
            raise
        except Exception as exc:  # recorded as FAILED: an attempt is never left unaudited
            log.exception("quarantine %s on tenant %s failed", plan.kind, tenant)
            return Facts(engine_result=f"executor_error:{type(exc).__name__.lower()}",
                         engine_ok=False, removal="not_checked", removal_ok=None,
                         threshold=request.start)

    async def _execute_fleet(self, fleet: Fleet, plan: QuarantinePlan,
                             request: QuarantineRequest, actor: str, probe: Probe) -> Facts:
        """The plan on every member of the fleet; the facts combine (quarantine/fleet.py)."""
        members = fleet.cache_members()
        tenant = request.tenant
        if plan.kind is PlanKind.WHOLE_PREFIX_FLUSH:
            per = await fleet_flush(members, tenant, self.gov.salt_for(tenant), probe,
                                    self.config)
            facts, state, codes = combine(per, verdict, "fleet_flush")
        elif plan.kind is PlanKind.SALT_ROTATION:
            per, old, new = await fleet_rotation(self.gov, members, tenant, actor, probe,
                                                 self.config)
            facts, state, codes = combine(per, verdict, "fleet_rotation", old, new)
        else:  # exact eviction is never planned for a fleet (its capabilities say so)
            raise QuarantineRequestError("exact eviction is not offered across a fleet",
                                         "require_exact")
        facts.decided = (state, tuple(codes))
        return facts

    async def _commit(self, request: QuarantineRequest, plan: QuarantinePlan,
                      facts: Facts | None, actor: str, started: int) -> QuarantineRecord:
        quarantine_id = f"q-{uuid.uuid4().hex}"
        length = span_length(request.span, facts)
        span_ref = SpanRef(span_digest(self.gov.salt_key, request.tenant, request.span.form,
                                       input_payload(request.span)), length or 0)
        reasons = [plan.reason, f"operator_reason={request.reason}",
                   f"span_form={request.span.form}"]
        if length is None:
            reasons.append("span_length_unmeasured")
        if request.start and plan.kind is not PlanKind.EXACT:
            reasons.append(f"span_start={request.start}")
        if facts is None:
            state, evidence = AuditState.REFUSED, Evidence()
        else:
            state, deciding = verdict(facts)
            reasons += [*facts.codes, *deciding]
            evidence = _evidence(facts)
        record = await self.gov.record(AuditEvent(
            kind="quarantine", actor=actor, state=state, tenant=request.tenant,
            plan=plan.kind.value, reasons=tuple(reasons), span=span_ref, evidence=evidence,
            request_id=quarantine_id))
        result = QuarantineRecord(quarantine_id, request.tenant, plan.kind.value, plan.degraded,
                                  state, tuple(reasons), span_ref, request.start, evidence,
                                  record.index, started, _now_ms())
        self._keep(result)
        if self.gov.quarantine_store is not None:
            await self.gov.quarantine_store.put(result.id, result.tenant, result.audit_index,
                                                result.to_json())
        return result

    def _keep(self, record: QuarantineRecord) -> None:
        self._records[record.id] = record
        while len(self._records) > self.config.max_records:
            self._records.popitem(last=False)

    def check_integrity(self) -> None:
        assert len(self._records) <= self.config.max_records
        for key, record in self._records.items():
            assert key == record.id
            assert 0 <= record.audit_index < self.gov.audit.size
            if record.state is AuditState.VERIFIED:
                ev = record.evidence
                assert ev.engine_result is not None and ev.kv_events is not None
                assert ev.probe_control_cached_tokens is not None
                assert ev.probe_after_cached_tokens is not None
                assert ev.probe_control_cached_tokens > record.start
                assert ev.probe_after_cached_tokens <= record.start


def span_length(span: SpanInput, facts: Facts | None) -> int | None:
    """Measured by the engine (exact cut), given (token ids), or reported by the probe."""
    if facts is not None and facts.span_tokens is not None:
        return facts.span_tokens
    if span.token_ids is not None:
        return len(span.token_ids)
    return facts.prompt_tokens if facts is not None else None


def _evidence(facts: Facts) -> Evidence:
    return Evidence(engine_result=facts.engine_result[:128], kv_events=facts.removal,
                    kv_seq_from=facts.kv_seq_from, kv_seq_to=facts.kv_seq_to,
                    probe_control_cached_tokens=facts.probe_control,
                    probe_after_cached_tokens=facts.probe_after,
                    old_epoch=facts.old_epoch, new_epoch=facts.new_epoch)


def _now_ms() -> int:
    return int(time.time() * 1000)
