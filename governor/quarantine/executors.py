"""Executing and observing a quarantine plan (docs/design.md §5, docs/security.md §7,
SEC-10/11), through the driver protocol's cache-control part only.

Each executor performs one plan and gathers the three independent facts SEC-11 asks for —
the engine's own result, removal evidence after a recorded point, and a canary probe — as a
`Facts` record; `governor.quarantine.service.verdict` turns facts into a state. Executors
never decide and never reach past `driver.cache_control`.

- `exact_span`: `evict_span` on an engine that offers it (the native engine in process, or
  `fak engine serve` over its cache-control route). Its own account must find nothing wrong
  (its cache checks); the KV events after the watermark must carry exactly the blocks it
  says it removed, with no lost batch.
- `whole_prefix_flush`: a reset (vLLM's dev-mode route), retried while it answers
  `{"success": false}` (requests running) until a bounded drain deadline; evidence is an
  `AllBlocksCleared` after the watermark with no lost batch.
- `salt_rotation`: the tenant's epoch bump (`Governor.rotate`); nothing is removed, so the
  evidence is that the tenant's salt changed, and the probe runs under the new salt.

The probe is the span's own request in the tenant's namespace: a positive control before
(it must hit past `start`), `cached_tokens` after (must not). The probe recomputes the span,
so an exact cut is made once more after it (and checked again); a flush or rotation leaves
the probe's fresh copy in the (new) namespace — see docs/operations.md.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from adapters.driver import CacheControl
from schemas.audit import AuditRecord, AuditState
from schemas.cache_control import (
    CacheControlUnsupported,
    KVMark,
    KVRemoval,
    ResetOutcome,
    SpanEviction,
    SpanSpec,
)
from schemas.engine import APIError, EngineCapabilities, Usage
from schemas.openai import Route


@dataclass(frozen=True, slots=True)
class QuarantineConfig:
    """`drain_timeout_s`: how long a refused reset is retried (every `retry_interval_s`);
    `kv_timeout_s`: how long to wait for KV-event evidence; `probe_timeout_s` bounds one probe
    request; `max_records`: quarantine records kept in memory for GET (all are in the log)."""

    drain_timeout_s: float = 10.0
    retry_interval_s: float = 0.25
    kv_timeout_s: float = 10.0
    probe_timeout_s: float = 120.0
    max_records: int = 10_000

    def __post_init__(self) -> None:
        for name in ("drain_timeout_s", "retry_interval_s", "kv_timeout_s", "probe_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if isinstance(self.max_records, bool) or not isinstance(self.max_records, int) \
                or self.max_records < 1:
            raise ValueError(f"max_records must be an int >= 1, got {self.max_records!r}")


@dataclass(frozen=True, slots=True)
class Probe:
    """The span's prompt as one engine request: route and body (without model or salt)."""

    route: Route
    body: dict[str, Any]


@dataclass(slots=True)
class Facts:
    """What an executor observed. `engine_ok`/`removal_ok`: True proven, False contradicted,
    None not established. Probe values are `cached_tokens` (None: no reading). `threshold`:
    the cached length the span may keep (its `start`); the control must exceed it, the
    after-probe must not. `codes` explain each fact (reason codes for the audit record)."""

    engine_result: str
    engine_ok: bool | None
    removal: str
    removal_ok: bool | None
    threshold: int
    probe_control: int | None = None
    probe_after: int | None = None
    kv_seq_from: int | None = None
    kv_seq_to: int | None = None
    old_epoch: int | None = None
    new_epoch: int | None = None
    prompt_tokens: int | None = None
    span_tokens: int | None = None
    codes: list[str] = field(default_factory=list)
    decided: tuple[AuditState, tuple[str, ...]] | None = None
    """Set for a fleet: the state its members' facts combine to (quarantine/fleet.py)."""


class Rotator(Protocol):
    """What a salt rotation needs of the governor."""

    def salt_for(self, tenant_id: str) -> str: ...

    async def rotate(self, tenant_id: str, actor: str) -> AuditRecord: ...


# --- probes -------------------------------------------------------------------------------


async def positive_control(control: CacheControl, caps: EngineCapabilities, tenant: str,
                           salt: str, probe: Probe, threshold: int, config: QuarantineConfig,
                           facts: Facts) -> None:
    """Send the span until it hits past `threshold` (at most twice: the first send caches it
    if it was not resident). Records the last reading and the prompt length."""
    if not caps.cached_tokens_in_usage:
        facts.codes.append("probe_unavailable_no_prompt_tokens_details")
        return
    for attempt in (1, 2):
        usage = await _probe_or_none(control, tenant, salt, probe, config, facts, "control")
        if usage is None:
            return
        facts.prompt_tokens = usage.prompt_tokens
        facts.probe_control = usage.cached_tokens
        if usage.cached_tokens is None:
            facts.codes.append("probe_unavailable_no_cached_tokens")
            return
        if usage.cached_tokens > threshold:
            facts.codes.append("span_resident_before" if attempt == 1 else "span_cached_by_control")
            return


async def after_probe(control: CacheControl, tenant: str, salt: str, probe: Probe,
                      config: QuarantineConfig, facts: Facts) -> None:
    usage = await _probe_or_none(control, tenant, salt, probe, config, facts, "after")
    if usage is not None:
        facts.probe_after = usage.cached_tokens
        facts.prompt_tokens = facts.prompt_tokens or usage.prompt_tokens


async def _probe_or_none(control: CacheControl, tenant: str, salt: str, probe: Probe,
                         config: QuarantineConfig, facts: Facts, which: str) -> Usage | None:
    try:
        usage = await control.probe(tenant, salt, probe.route, probe.body,
                                    config.probe_timeout_s)
    except APIError as err:
        facts.codes.append(f"probe_{which}_engine_error_{err.status}")
        return None
    except TimeoutError:
        facts.codes.append(f"probe_{which}_timeout")
        return None
    if usage is None:
        facts.codes.append(f"probe_{which}_no_usage")
    return usage


# --- exact span ---------------------------------------------------------------------------


async def exact_span(control: CacheControl, caps: EngineCapabilities, tenant: str, salt: str,
                     span: SpanSpec, start: int, probe: Probe,
                     config: QuarantineConfig) -> Facts:
    """Raises ValueError when the engine cannot take the span (e.g. start past its end)."""
    facts = Facts(engine_result="not_run", engine_ok=None, removal="kv_events_unavailable",
                  removal_ok=None, threshold=start)
    await positive_control(control, caps, tenant, salt, probe, start, config, facts)
    mark = await control.kv_mark(config.kv_timeout_s)
    cut = await control.evict_span(salt, span, start)
    facts.span_tokens = cut.span_tokens
    facts.engine_result = f"evicted_tokens={cut.evicted_tokens}"
    await _removal_evidence(control, mark, cut, config, facts)
    await after_probe(control, tenant, salt, probe, config, facts)
    # The probe recomputed the span; cut it again so the quarantine leaves it evicted.
    cleanup = await control.evict_span(salt, span, start)
    facts.codes.append(f"probe_recompute_evicted_tokens={cleanup.evicted_tokens}")
    problems = [*cut.problems, *cleanup.problems]
    facts.engine_ok = not problems
    facts.codes += problems or list(cut.checks)
    return facts


async def _removal_evidence(control: CacheControl, mark: KVMark | None, cut: SpanEviction,
                            config: QuarantineConfig, facts: Facts) -> None:
    """The BlockRemoved set after the watermark must be the engine's removed set."""
    if mark is None:
        return
    if not cut.removed_blocks:
        facts.removal, facts.removal_ok = "no_full_block_removed", True
        facts.codes.append("kv_no_block_left_the_cache")
        return

    def arrived(ev: KVRemoval) -> bool:
        return cut.removed_blocks <= ev.removed

    evidence = await control.kv_removal(mark, arrived, config.kv_timeout_s)
    facts.kv_seq_from, facts.kv_seq_to = evidence.seq_from, evidence.seq_to
    if not evidence.gap_free:
        facts.removal, facts.removal_ok = "kv_seq_gap", None
    elif not arrived(evidence):
        facts.removal, facts.removal_ok = "kv_block_removed_missing", None
    elif evidence.removed != cut.removed_blocks:
        # Other removals may interleave (other tenants' evictions); only the span's own
        # must all be there. Extra ones are noted, not held against the cut.
        facts.removal, facts.removal_ok = "block_removed_set_ok", True
        facts.codes.append(f"kv_other_removals={len(evidence.removed - cut.removed_blocks)}")
    else:
        facts.removal, facts.removal_ok = "block_removed_set_ok", True
    facts.codes.append(f"kv_blocks_removed={len(cut.removed_blocks)}")


# --- whole-prefix flush -----------------------------------------------------------------


async def flush(control: CacheControl, caps: EngineCapabilities, tenant: str, salt: str,
                probe: Probe, config: QuarantineConfig) -> Facts:
    facts = Facts(engine_result="not_run", engine_ok=None, removal="kv_events_unavailable",
                  removal_ok=None, threshold=0)
    await positive_control(control, caps, tenant, salt, probe, 0, config, facts)
    mark = await control.kv_mark(config.kv_timeout_s)
    await _reset_with_drain(control, config, facts)
    if facts.engine_ok is False:
        return facts  # the span is still cached; a probe would prove nothing
    # The after-probe is also the one-step nudge an idle vLLM needs to publish the clear.
    await after_probe(control, tenant, salt, probe, config, facts)
    if mark is not None:
        evidence = await control.kv_removal(mark, lambda ev: ev.cleared, config.kv_timeout_s)
        facts.kv_seq_from, facts.kv_seq_to = evidence.seq_from, evidence.seq_to
        if not evidence.gap_free:
            facts.removal, facts.removal_ok = "kv_seq_gap", None
        elif not evidence.cleared:
            facts.removal, facts.removal_ok = "kv_no_all_blocks_cleared", None
        else:
            facts.removal, facts.removal_ok = "all_blocks_cleared", True
    return facts


async def _reset_with_drain(control: CacheControl, config: QuarantineConfig,
                            facts: Facts) -> None:
    """Reset; while the engine answers `{"success": false}` (requests running), wait and
    retry until the drain deadline. Anything else than success is a result, not retried."""
    deadline = time.monotonic() + config.drain_timeout_s
    attempts = 0
    while True:
        attempts += 1
        try:
            result = await control.reset_prefix_cache()
        except CacheControlUnsupported:
            facts.engine_result, facts.engine_ok = "reset_unsupported", False
            return
        except APIError as err:
            facts.engine_result, facts.engine_ok = f"reset_transport_error_{err.status}", False
            return
        busy = result.outcome is ResetOutcome.FAILED and result.status in (0, 200)
        if not busy or time.monotonic() + config.retry_interval_s > deadline:
            break
        await asyncio.sleep(config.retry_interval_s)
    facts.codes.append(f"reset_attempts={attempts}")
    if result.outcome is ResetOutcome.SUCCEEDED:
        facts.engine_result, facts.engine_ok = "reset_succeeded", True
        if attempts > 1:
            facts.codes.append("reset_succeeded_after_drain")
    elif result.outcome is ResetOutcome.UNKNOWN:
        facts.engine_result, facts.engine_ok = "reset_outcome_unknown", None
    elif busy:
        facts.engine_result, facts.engine_ok = "reset_refused_requests_running", False
        facts.codes.append("drain_deadline_passed")
    else:
        facts.engine_result, facts.engine_ok = f"reset_http_{result.status}", False


# --- salt rotation ------------------------------------------------------------------------


async def rotate_salt(gov: Rotator, control: CacheControl, caps: EngineCapabilities,
                      tenant: str, actor: str, probe: Probe, config: QuarantineConfig) -> Facts:
    """Bump the tenant's epoch (audited by `Governor.rotate`); probe old, then new salt."""
    facts = Facts(engine_result="not_run", engine_ok=None, removal="not_applicable",
                  removal_ok=None, threshold=0)
    old_salt = gov.salt_for(tenant)
    await positive_control(control, caps, tenant, old_salt, probe, 0, config, facts)
    rotation = await gov.rotate(tenant, actor=actor)
    rotated = rotation.event.evidence
    assert rotated is not None
    facts.old_epoch, facts.new_epoch = rotated.old_epoch, rotated.new_epoch
    new_salt = gov.salt_for(tenant)
    facts.engine_result, facts.engine_ok = "epoch_bumped", new_salt != old_salt
    # Nothing is removed: the old namespace is unreachable and its blocks age out.
    facts.removal = "namespace_replaced" if new_salt != old_salt else "salt_unchanged"
    facts.removal_ok = new_salt != old_salt
    if rotation.event.state is AuditState.UNVERIFIED:  # a replica missed the epoch (postgres)
        facts.removal, facts.removal_ok = "replicas_unconfirmed", None
        facts.codes += [r for r in rotation.event.reasons if r.startswith("replica_missed=")]
    facts.codes.append("old_blocks_age_out")
    await after_probe(control, tenant, new_salt, probe, config, facts)
    return facts
