"""Exact-span eviction with the engine's own account of it (docs/design.md §5, SEC-11).

`cut_span` runs on the engine thread (one call, no step in between): it snapshots the
radix tree, evicts, snapshots again and reads the path back, so it can say that every
other namespace kept its exact slot set, the tenant lost exactly the evicted slots, the
tokens before `start` stayed and the path is reusable to at most `start`. With a KV-event
recorder it also names the full blocks that left the cache, as the events that published
the removal name them. Used by the in-process driver and by `fak engine serve`'s cache
control route alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from native_engine.engine import LLMEngine
from native_engine.kvcache.block_hash import hash_to_wire
from native_engine.kvcache.events import KVEventRecorder
from schemas.cache_control import BlockHash, SpanEviction
from schemas.kv_events import BlockRemoved


@dataclass(frozen=True, slots=True)
class CutReport:
    """One eviction and the radix tree around it, observed in a single engine-thread call."""

    evicted: int
    others_unchanged: bool
    removed_only_evicted: bool
    prefix_kept: bool
    reusable_after: int
    removed_blocks: frozenset[BlockHash]
    kv_seq: int | None

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

    def eviction(self, span_tokens: int, start: int) -> SpanEviction:
        problems = tuple(self.problems(start))
        checks = () if problems else ("radix_other_namespaces_unchanged",
                                      "radix_span_cut_at_start")
        return SpanEviction(span_tokens, self.evicted, self.removed_blocks, self.kv_seq,
                            problems, checks)


def _resident(engine: LLMEngine) -> dict[str | None, frozenset[int]]:
    cache = engine.cache
    assert cache is not None
    return {ns: frozenset(s for node in cache.nodes(ns) for s in node.slots)
            for ns in cache.namespaces}


def reusable(engine: LLMEngine, namespace: str, tokens: Sequence[int]) -> int:
    """Cached length of `tokens` in `namespace` (a sentinel token lifts match's cap of
    len - 1; the sentinel itself is never matched)."""
    assert engine.cache is not None
    return engine.cache.match(namespace, [*tokens, 0]).length


def cut_span(engine: LLMEngine, namespace: str, tokens: Sequence[int], start: int,
             wire_hash: bool = False) -> CutReport:
    """Runs on the engine thread: snapshot, `evict_span`, snapshot, read the path back.
    `wire_hash`: name removed blocks as the ZeroMQ wire does (uint64 fold of the digest)."""
    if engine.cache is None:
        raise ValueError("the engine runs without a prefix cache")
    if not 0 <= start < len(tokens):
        raise ValueError(f"start {start} is not inside the span's {len(tokens)} tokens")
    prefix_before = reusable(engine, namespace, tokens[:start]) if start else 0
    before = _resident(engine)
    evicted = engine.evict_span(namespace, tokens, start)
    after = _resident(engine)
    removed, seq = _removed_blocks(engine, wire_hash)
    empty: frozenset[int] = frozenset()
    others = {ns for ns in before.keys() | after.keys() if ns != namespace}
    mine_before, mine_after = before.get(namespace, empty), after.get(namespace, empty)
    return CutReport(
        evicted=evicted,
        others_unchanged=all(before.get(ns, empty) == after.get(ns, empty) for ns in others),
        removed_only_evicted=mine_after <= mine_before
        and len(mine_before) - len(mine_after) == evicted,
        prefix_kept=(reusable(engine, namespace, tokens[:start]) if start else 0)
        == prefix_before,
        reusable_after=reusable(engine, namespace, tokens),
        removed_blocks=removed,
        kv_seq=seq,
    )


def _removed_blocks(engine: LLMEngine, wire_hash: bool) -> tuple[frozenset[BlockHash],
                                                                  int | None]:
    """The blocks the eviction's KV-event batch removed, and that batch's seq."""
    recorder = engine.listener
    if not isinstance(recorder, KVEventRecorder):
        return frozenset(), None
    removed: set[BlockHash] = set()
    for event in recorder.last_batch:
        if isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                removed.add(hash_to_wire(h, True) if wire_hash and isinstance(h, bytes) else h)
    return frozenset(removed), recorder.last_seq
