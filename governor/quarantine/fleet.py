"""A quarantine across a fleet (docs/design.md §7): the plan runs on every member (upstream,
rank) that can hold the tenant's blocks, each gathering its own three facts.

- flush: each member in turn — its positive control, its KV watermark, the reset (of its
  server), its KV evidence after the watermark, its after-probe;
- rotation: the positive control under the old salt on every member, one epoch bump, the
  after-probe under the new salt on every member.

A member that is down is recorded as `member_down` (UNVERIFIED), never skipped. The
quarantine is VERIFIED only when every member's facts are (`combine`), FAILED if any member
FAILED, else UNVERIFIED; the record lists each member's facts as reason codes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from adapters.driver import CacheMember
from schemas.audit import AuditState

from .executors import (
    Facts,
    Probe,
    QuarantineConfig,
    Rotator,
    after_probe,
    flush,
    positive_control,
)

Verdict = Callable[[Facts], tuple[AuditState, tuple[str, ...]]]


@dataclass(frozen=True, slots=True)
class MemberFacts:
    name: str
    facts: Facts


def member_down() -> Facts:
    return Facts(engine_result="member_down", engine_ok=None, removal="not_checked",
                 removal_ok=None, threshold=0, codes=["member_down"])


async def fleet_flush(members: Sequence[CacheMember], tenant: str, salt: str, probe: Probe,
                      config: QuarantineConfig) -> list[MemberFacts]:
    out = []
    for member in members:
        facts = await flush(member.cache_control, member.capabilities, tenant, salt, probe,
                            config) if member.up else member_down()
        out.append(MemberFacts(member.name, facts))
    return out


async def fleet_rotation(gov: Rotator, members: Sequence[CacheMember], tenant: str,
                         actor: str, probe: Probe, config: QuarantineConfig
                         ) -> tuple[list[MemberFacts], int | None, int | None]:
    """Per-member facts and the (old, new) epoch of the one bump."""
    old_salt = gov.salt_for(tenant)
    out = [MemberFacts(m.name, Facts(engine_result="not_run", engine_ok=None,
                                     removal="not_applicable", removal_ok=None, threshold=0)
                       if m.up else member_down()) for m in members]
    for member, entry in zip(members, out, strict=True):
        if member.up:
            await positive_control(member.cache_control, member.capabilities, tenant,
                                   old_salt, probe, 0, config, entry.facts)
    rotated = (await gov.rotate(tenant, actor=actor)).event.evidence
    assert rotated is not None
    new_salt = gov.salt_for(tenant)
    for member, entry in zip(members, out, strict=True):
        if not member.up:
            continue
        facts = entry.facts
        facts.engine_result, facts.engine_ok = "epoch_bumped", new_salt != old_salt
        facts.removal = "namespace_replaced" if new_salt != old_salt else "salt_unchanged"
        facts.removal_ok = new_salt != old_salt
        await after_probe(member.cache_control, tenant, new_salt, probe, config, facts)
    return out, rotated.old_epoch, rotated.new_epoch


def combine(members: Sequence[MemberFacts], verdict: Verdict, plan: str,
            old_epoch: int | None = None, new_epoch: int | None = None
            ) -> tuple[Facts, AuditState, list[str]]:
    """The fleet's facts (aggregates for the record's evidence), its state and the reason
    codes naming each member's facts."""
    states, codes = [], []
    for entry in members:
        state, deciding = verdict(entry.facts)
        states.append(state)
        f = entry.facts
        prefix = f"member={entry.name}"
        codes += [f"{prefix}:state={state.value.lower()}", f"{prefix}:engine={f.engine_result}",
                  f"{prefix}:removal={f.removal}",
                  f"{prefix}:control={_count(f.probe_control)}",
                  f"{prefix}:after={_count(f.probe_after)}",
                  *(f"{prefix}:{d}" for d in deciding if state is not AuditState.VERIFIED)]
    if AuditState.FAILED in states:
        state = AuditState.FAILED
    elif all(s is AuditState.VERIFIED for s in states) and states:
        state = AuditState.VERIFIED
    else:
        state = AuditState.UNVERIFIED
    verified = sum(s is AuditState.VERIFIED for s in states)
    controls = [m.facts.probe_control for m in members]
    afters = [m.facts.probe_after for m in members]
    facts = Facts(
        engine_result=plan, engine_ok=all(m.facts.engine_ok for m in members) or None,
        removal=f"members_verified={verified}/{len(members)}",
        removal_ok=state is AuditState.VERIFIED or None, threshold=0,
        probe_control=None if None in controls else min(controls),  # type: ignore[type-var]
        probe_after=None if None in afters else max(afters),  # type: ignore[type-var]
        old_epoch=old_epoch, new_epoch=new_epoch,
        prompt_tokens=next((m.facts.prompt_tokens for m in members if m.facts.prompt_tokens),
                           None))
    return facts, state, codes


def _count(value: int | None) -> str:
    return "none" if value is None else str(value)
