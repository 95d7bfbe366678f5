"""Executing and observing a quarantine on an engine (docs/design.md §5, docs/security.md §7,
SEC-10/11).

Each executor performs one plan and gathers the three independent facts SEC-11 asks for —
the engine's own result, removal evidence after a recorded point, and a canary probe — as a
`Facts` record; `governor.quarantine.verdict` turns facts into a state. Executors never decide.

- `exact_native`: `evict_span` on the native engine. The removal evidence is the radix tree
  itself, read on the engine thread in the same call as the eviction (no step runs between
  the snapshots): every other namespace keeps its exact slot set, the tenant loses exactly the
  evicted slots, tokens before `start` stay, and the path is reusable to at most `start`.
- `whole_prefix_flush`: `POST /reset_prefix_cache` on a vLLM declared dev-mode, retried while
  it answers `{"success": false}` (requests running) until a bounded drain deadline; evidence
  is an `AllBlocksCleared` after a KV-event watermark with no lost batch in between.
- `salt_rotation`: the tenant's epoch bump (`Governor.rotate`); nothing is removed, so the
  evidence is that the tenant's salt changed, and the probe runs under the new salt.

The probe is the span's own prompt in the tenant's namespace: a positive control before (it
must hit past `start`), `cached_tokens` after (must not). The probe recomputes the span, so on
the native engine the span is cut once more after it (and checked again); on vLLM the probe
leaves a freshly computed copy in the (new) namespace — see docs/operations.md.
No engine lock is held while waiting: engine-thread calls are short functions, waits are
asyncio sleeps between them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from adapters.vllm.dev_control import DevControlDisabledError, ResetOutcome, VLLMDevControl
from adapters.vllm.kv_subscriber import KVEventSubscriber, SyncState, Watermark
from schemas.audit import AuditState
from schemas.engine import EngineCapabilities, EngineError, EngineRequest, Usage
from schemas.kv_events import AllBlocksCleared

if TYPE_CHECKING:  # torch is imported only when the native engine is the engine
    from adapters.native import NativeDriver
    from native_engine.engine import LLMEngine


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

    route: str
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
    codes: list[str] = field(default_factory=list)


# --- probes -------------------------------------------------------------------------------


async def probe_usage(driver: Any, tenant: str, salt: str, probe: Probe,
                      timeout_s: float) -> Usage | None:
    """One non-streaming, one-token, greedy request of the span in `salt`'s namespace."""
    body = {**probe.body, "max_tokens": 1, "temperature": 0}
    body.setdefault("model", driver.capabilities.model_id)
    request = EngineRequest(request_id=f"fak-quarantine-probe-{uuid.uuid4().hex}",
                            route=probe.route,  # type: ignore[arg-type]
                            body=body, tenant=tenant, cache_salt=salt)
    usage = None
    async with contextlib.aclosing(driver.generate(request)) as chunks:
        async with asyncio.timeout(timeout_s):
            async for chunk in chunks:
                usage = chunk.usage or usage
    return usage


async def positive_control(driver: Any, tenant: str, salt: str, probe: Probe, threshold: int,
                           timeout_s: float, facts: Facts) -> None:
    """Send the span until it hits past `threshold` (at most twice: the first send caches it
    if it was not resident). Records the last reading and the prompt length."""
    for attempt in (1, 2):
        usage = await _probe_or_none(driver, tenant, salt, probe, timeout_s, facts, "control")
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


async def after_probe(driver: Any, tenant: str, salt: str, probe: Probe, timeout_s: float,
                      facts: Facts) -> None:
    usage = await _probe_or_none(driver, tenant, salt, probe, timeout_s, facts, "after")
    if usage is not None:
        facts.probe_after = usage.cached_tokens


async def _probe_or_none(driver: Any, tenant: str, salt: str, probe: Probe, timeout_s: float,
                         facts: Facts, which: str) -> Usage | None:
    try:
        usage = await probe_usage(driver, tenant, salt, probe, timeout_s)
    except EngineError as err:
        facts.codes.append(f"probe_{which}_engine_error_{err.status}")
        return None
    except TimeoutError:
        facts.codes.append(f"probe_{which}_timeout")
        return None
    if usage is None:
        facts.codes.append(f"probe_{which}_no_usage")
    return usage


# --- exact eviction on the native engine -------------------------------------------------


@dataclass(frozen=True, slots=True)
class CutReport:
    """One eviction and the radix tree around it, observed in a single engine-thread call."""

    evicted: int
    others_unchanged: bool
    removed_only_evicted: bool
    prefix_kept: bool
    reusable_after: int

    def problems(self, start: int) -> list[str]:
        found = []
        if not self.others_unchanged:
            found.append("radix_other_namespace_changed")
        if not self.removed_only_evicted:
            found.append("radix_removed_set_mismatch")
        if not self.prefix_kept:
            found.append("radix_prefix_before_start_changed")
        if self.reusable_after > start:
            found.append(f"radix_span_still_reusable={self.reusable_after}")
        return found


def _resident(engine: LLMEngine) -> dict[str | None, frozenset[int]]:
    cache = engine.cache
    assert cache is not None
    return {ns: frozenset(s for node in cache.nodes(ns) for s in node.slots)
            for ns in cache.namespaces}


def _reusable(engine: LLMEngine, namespace: str, tokens: Sequence[int]) -> int:
    """Cached length of `tokens` in `namespace` (a sentinel token lifts match's cap of
    len - 1; the sentinel itself is never matched)."""
    assert engine.cache is not None
    return engine.cache.match(namespace, [*tokens, 0]).length


def cut_span(engine: LLMEngine, namespace: str, tokens: Sequence[int], start: int) -> CutReport:
    """Runs on the engine thread: snapshot, `evict_span`, snapshot, read the path back."""
    prefix_before = _reusable(engine, namespace, tokens[:start]) if start else 0
    before = _resident(engine)
    evicted = engine.evict_span(namespace, tokens, start)
    after = _resident(engine)
    empty: frozenset[int] = frozenset()
    others = {ns for ns in before.keys() | after.keys() if ns != namespace}
    mine_before, mine_after = before.get(namespace, empty), after.get(namespace, empty)
    return CutReport(
        evicted=evicted,
        others_unchanged=all(before.get(ns, empty) == after.get(ns, empty) for ns in others),
        removed_only_evicted=mine_after <= mine_before
        and len(mine_before) - len(mine_after) == evicted,
        prefix_kept=(_reusable(engine, namespace, tokens[:start]) if start else 0)
        == prefix_before,
        reusable_after=_reusable(engine, namespace, tokens),
    )


async def exact_native(driver: NativeDriver, tenant: str, salt: str, tokens: Sequence[int],
                       start: int, config: QuarantineConfig) -> Facts:
    facts = Facts(engine_result="not_run", engine_ok=None, removal="radix_not_checked",
                  removal_ok=None, threshold=start)
    engine = driver.engine
    if engine is None or not engine.is_alive or engine.engine.cache is None:
        facts.engine_result, facts.engine_ok = "native_engine_unavailable", False
        return facts
    probe = Probe("completions", {"prompt": list(tokens)})
    await positive_control(driver, tenant, salt, probe, start, config.probe_timeout_s, facts)
    cut = await engine.call(lambda e: cut_span(e, salt, tokens, start))
    facts.engine_result, facts.engine_ok = f"evicted_tokens={cut.evicted}", True
    await after_probe(driver, tenant, salt, probe, config.probe_timeout_s, facts)
    # The probe recomputed the span; cut it again so the quarantine leaves it evicted.
    cleanup = await engine.call(lambda e: cut_span(e, salt, tokens, start))
    facts.codes.append(f"probe_recompute_evicted_tokens={cleanup.evicted}")
    problems = cut.problems(start) + cleanup.problems(start)
    facts.removal_ok = not problems
    facts.removal = "radix_checked_ok" if not problems else "radix_checked_mismatch"
    facts.codes += problems or ["radix_other_namespaces_unchanged", "radix_span_cut_at_start"]
    return facts


# --- whole-prefix flush on a ridden vLLM -------------------------------------------------


async def flush_vllm(driver: Any, tenant: str, salt: str, probe: Probe,
                     config: QuarantineConfig) -> Facts:
    facts = Facts(engine_result="not_run", engine_ok=None, removal="kv_events_unavailable",
                  removal_ok=None, threshold=0)
    control: VLLMDevControl | None = getattr(driver, "dev_control", None)
    if control is None:
        facts.engine_result, facts.engine_ok = "no_dev_control_client", False
        return facts
    kv: KVEventSubscriber | None = getattr(driver, "kv", None)
    await _control_if_readable(driver, tenant, salt, probe, config, facts)
    marks = await _watermarks(kv, config.kv_timeout_s)
    await _reset_with_drain(control, config, facts)
    if facts.engine_ok is False:
        return facts  # the span is still cached; a probe would prove nothing
    # The after-probe is also the one-step nudge an idle vLLM needs to publish the clear.
    await after_probe(driver, tenant, salt, probe, config.probe_timeout_s, facts)
    if kv is not None and marks:
        await _await_cleared(kv, marks, config.kv_timeout_s, facts)
    return facts


async def _control_if_readable(driver: Any, tenant: str, salt: str, probe: Probe,
                               config: QuarantineConfig, facts: Facts) -> None:
    caps: EngineCapabilities = driver.capabilities
    if caps.cached_tokens_in_usage:
        await positive_control(driver, tenant, salt, probe, 0, config.probe_timeout_s, facts)
    else:
        facts.codes.append("probe_unavailable_no_prompt_tokens_details")


async def _watermarks(kv: KVEventSubscriber | None, settle_s: float) -> dict[int, Watermark]:
    """Each rank's watermark, once the subscriber has caught up (bounded wait)."""
    if kv is None:
        return {}
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline and not (
            kv.ranks() and all(kv.state(r) is SyncState.SYNCED for r in kv.ranks())):
        await asyncio.sleep(0.05)
    return {rank: kv.watermark(rank) for rank in kv.ranks() or (0,)}


async def _reset_with_drain(control: VLLMDevControl, config: QuarantineConfig,
                            facts: Facts) -> None:
    """Reset; while vLLM answers `{"success": false}` (requests running), wait and retry
    until the drain deadline. Anything else than success is a result, not retried."""
    deadline = time.monotonic() + config.drain_timeout_s
    attempts = 0
    while True:
        attempts += 1
        try:
            result = await control.reset_prefix_cache()
        except DevControlDisabledError:
            facts.engine_result, facts.engine_ok = "dev_control_disabled", False
            return
        except EngineError as err:
            facts.engine_result, facts.engine_ok = f"reset_transport_error_{err.status}", False
            return
        busy = result.outcome is ResetOutcome.FAILED and result.status == 200
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


async def _await_cleared(kv: KVEventSubscriber, marks: dict[int, Watermark], timeout_s: float,
                         facts: Facts) -> None:
    """Wait for an `AllBlocksCleared` (every medium) after each rank's watermark."""
    deadline = time.monotonic() + timeout_s
    while True:
        evidence = {rank: kv.evidence_since(mark) for rank, mark in marks.items()}
        cleared = all(any(isinstance(e, AllBlocksCleared) and e.medium is None
                          for b in ev.batches for e in b.events) for ev in evidence.values())
        if cleared or time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.05)
    first = evidence[min(evidence)]
    mark = marks[min(marks)]
    facts.kv_seq_from = 0 if mark.seq is None else mark.seq + 1
    facts.kv_seq_to = first.batches[-1].seq if first.batches else None
    if not all(ev.gap_free for ev in evidence.values()):
        facts.removal, facts.removal_ok = "kv_seq_gap", None
    elif not cleared:
        facts.removal, facts.removal_ok = "kv_no_all_blocks_cleared", None
    else:
        facts.removal, facts.removal_ok = "all_blocks_cleared", True


# --- salt rotation ------------------------------------------------------------------------


async def rotate_salt(gov: Any, tenant: str, actor: str, probe: Probe,
                      config: QuarantineConfig) -> Facts:
    """Bump the tenant's epoch (audited by `Governor.rotate`); probe old, then new salt."""
    facts = Facts(engine_result="not_run", engine_ok=None, removal="not_applicable",
                  removal_ok=None, threshold=0)
    old_salt = gov.salt_for(tenant)
    await _control_if_readable(gov.driver, tenant, old_salt, probe, config, facts)
    rotation = await gov.rotate(tenant, actor=actor)
    rotated = rotation.event.evidence
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
    await after_probe(gov.driver, tenant, new_salt, probe, config.probe_timeout_s, facts)
    return facts
