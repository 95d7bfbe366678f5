"""RadixCache: matching, splitting, namespaces, eviction, exact-span eviction, events, and
integrity (no leak, no double free, refcounts, lock counts) under random operation sequences.

A simulated KV store records, for each written slot, the (namespace, token path) that the
token's KV was computed from; every cached node's slots must still hold exactly its own path,
so a block freed and rewritten while still cached would be caught.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from native_engine.kvcache.block_pool import BlockPool
from native_engine.kvcache.radix_cache import Node, RadixCache, chain_hashes, lru_victims

B = 4


def fill(pool: BlockPool, cache: RadixCache, ns: str | None, tokens: list[int]) -> Node | None:
    """Compute `tokens` into fresh blocks, cache them, and drop the request's own refs."""
    table = pool.allocate(pool.blocks_for(len(tokens)))
    node = cache.insert(ns, tokens, pool.slots(table, 0, len(tokens))).node
    pool.decref(table)
    return node


def test_match_never_covers_whole_prompt_and_splits() -> None:
    pool = BlockPool(16, B)
    cache = RadixCache(pool)
    fill(pool, cache, None, [1, 2, 3, 4, 5, 6])
    assert cache.match(None, [1, 2, 3, 4, 5, 6]).length == 5
    m = cache.match(None, [1, 2, 3, 9])
    assert m.length == 3 and m.node is not None and m.node.end == 3
    assert [len(n.tokens) for n in cache.nodes(None)] in ([3, 2, 1], [3, 1, 2])
    assert cache.match(None, [7, 1]).length == 0
    assert cache.match(None, [1]).length == 0
    cache.check_integrity([], {})


def test_insert_reports_existing_and_keeps_first_slots() -> None:
    pool = BlockPool(16, B)
    cache = RadixCache(pool)
    fill(pool, cache, None, [1, 2, 3, 4, 5])
    first = cache.match(None, [1, 2, 3, 4, 5, 0]).slots
    table = pool.allocate(2)
    result = cache.insert(None, [1, 2, 3, 4, 5, 6, 7], pool.slots(table, 0, 7))
    assert result.existing == 5
    assert cache.match(None, [1, 2, 3, 4, 5, 6, 7, 0]).slots[:5] == first
    pool.decref(table)
    cache.check_integrity([], {})


def test_namespaces_never_share_nodes() -> None:
    pool = BlockPool(16, B)
    cache = RadixCache(pool)
    fill(pool, cache, "tenant-a", [1, 2, 3, 4, 5, 6])
    assert cache.match("tenant-b", [1, 2, 3, 4, 5, 6]).length == 0
    assert cache.match(None, [1, 2, 3, 4, 5, 6]).length == 0
    fill(pool, cache, "tenant-b", [1, 2, 3, 4, 5, 6])
    a = {s for n in cache.nodes("tenant-a") for s in n.slots}
    b = {s for n in cache.nodes("tenant-b") for s in n.slots}
    assert a and b and not a & b
    assert cache.evict_span("tenant-a", [1, 2, 3], 0) == 6
    assert cache.match("tenant-b", [1, 2, 3, 4, 5, 6]).length == 5
    cache.check_integrity([], {})


def test_evict_lru_skips_locked_and_frees_blocks() -> None:
    pool = BlockPool(6, B)
    cache = RadixCache(pool)
    fill(pool, cache, None, [1] * 8)  # 2 blocks, oldest
    fill(pool, cache, None, [2] * 8)
    locked = cache.match(None, [2] * 9).node
    cache.lock(locked)
    assert pool.num_free == 2
    assert cache.evict(2) == 2
    assert cache.match(None, [1] * 9).length == 0
    assert cache.match(None, [2] * 9).length == 8
    assert cache.evict(10) == 0  # only locked KV left
    cache.unlock(locked)
    assert cache.evict(10) == 2 and pool.num_free == 6
    cache.check_integrity([], {})


def test_default_eviction_is_value_aware() -> None:
    pool = BlockPool(4, B)
    cache = RadixCache(pool)
    fill(pool, cache, None, [1] * 8)
    for _ in range(5):
        cache.match(None, [1] * 9)  # often reused, but then idle
    fill(pool, cache, None, [2] * 8)  # newer, never reused: LRU would keep it
    assert cache.evict(1) == 2
    assert cache.match(None, [1] * 9).length == 8 and cache.match(None, [2] * 9).length == 0
    lru = RadixCache(BlockPool(4, B), choose_victims=lru_victims)
    fill(lru.pool, lru, None, [1] * 8)
    lru.match(None, [1] * 9)
    fill(lru.pool, lru, None, [2] * 8)
    lru.evict(1)
    assert lru.match(None, [1] * 9).length == 0


def test_evict_span_cuts_at_start_and_keeps_other_paths() -> None:
    pool = BlockPool(32, B)
    cache = RadixCache(pool)
    base = [1, 2, 3, 4, 5, 6]
    p1, p2, p3 = [*base, 7, 8, 9], [*base, 7, 10, 11], [*base[:4], 20, 21]
    for path in (p1, p2, p3):
        fill(pool, cache, None, path)
    before = {tuple(p): cache.match(None, [*p, 0]).slots for p in (p1, p2, p3)}
    # Span [5, 9) of p1: its KV from position 5 on goes, with p2 (shares tokens[:6]).
    assert cache.evict_span(None, p1, 5) == 4 + 2
    assert cache.match(None, [*p1, 0]).length == 5
    assert cache.match(None, [*p2, 0]).length == 5
    assert cache.match(None, [*p3, 0]).slots == before[tuple(p3)]
    assert cache.match(None, [*p1, 0]).slots == before[tuple(p1)][:5]
    # A path that leaves the span before its start, or a start past the cache, removes nothing.
    assert cache.evict_span(None, [1, 2, 9, 9, 9], 3) == 0
    assert cache.evict_span(None, p1, 5) == 0
    with pytest.raises(ValueError):
        cache.evict_span(None, p1, len(p1))
    cache.check_integrity([], {})


def test_evict_span_at_node_boundary_and_locked() -> None:
    pool = BlockPool(32, B)
    cache = RadixCache(pool)
    fill(pool, cache, None, [1, 2, 3, 4])
    fill(pool, cache, None, [1, 2, 3, 4, 5, 6])
    node = cache.match(None, [1, 2, 3, 4, 5, 6, 0]).node
    cache.lock(node)  # a running request's lock does not protect the span
    assert cache.evict_span(None, [1, 2, 3, 4, 5], 4) == 2
    assert cache.match(None, [1, 2, 3, 4, 5, 6, 0]).length == 4
    cache.check_integrity([node], {})
    cache.unlock(node)  # unlocking through the detached node still balances the ancestors
    cache.check_integrity([], {})


def test_reset_refused_while_locked() -> None:
    pool = BlockPool(8, B)
    cache = RadixCache(pool)
    node = fill(pool, cache, "x", [1, 2, 3, 4, 5])
    cache.lock(node)
    assert not cache.reset()
    assert cache.num_tokens == 5
    cache.unlock(node)
    assert cache.reset()
    assert cache.num_tokens == 0 and pool.num_free == 8
    cache.check_integrity([], {})


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def on_blocks_stored(self, namespace, block_hashes, parent_block_hash, token_ids, block_size):
        self.events.append(("stored", namespace, list(block_hashes), parent_block_hash,
                            list(token_ids)))

    def on_blocks_removed(self, namespace, block_hashes):
        self.events.append(("removed", namespace, list(block_hashes)))

    def on_cleared(self):
        self.events.append(("cleared",))


def test_events_name_every_full_block() -> None:
    pool = BlockPool(16, B)
    rec = Recorder()
    cache = RadixCache(pool, rec)
    tokens = list(range(10))
    fill(pool, cache, "ns", tokens)
    h = chain_hashes("ns", tokens, B)
    assert len(h) == 2 and rec.events == [("stored", "ns", h, None, tokens[:8])]
    assert chain_hashes(None, tokens, B) != h  # the namespace is folded into block 0
    fill(pool, cache, "ns", [*tokens, 10, 11, 12])  # completes block 2 only
    h3 = chain_hashes("ns", [*tokens, 10, 11], B)
    assert rec.events[-1] == ("stored", "ns", [h3[2]], h[1], [8, 9, 10, 11])
    rec.events.clear()
    cache.evict_span("ns", tokens, 6)  # cuts inside block 1: blocks 1 and 2 go
    assert sorted(e for ev in rec.events for e in ev[2]) == sorted([h[1], h3[2]])
    cache.reset()
    assert rec.events[-1] == ("cleared",)


@dataclass
class Holder:
    ns: str | None
    tokens: list[int]
    table: list[int]
    node: Node | None


def attached_lock(node: Node | None) -> bool:
    """Whether a lock held on `node` still pins a node in the tree (span eviction detaches)."""
    while node is not None and node.parent is not None:
        if not node.detached:
            return True
        node = node.parent
    return False


class CacheMachine(RuleBasedStateMachine):
    """Requests (holders) match, share whole blocks, copy partial ones, insert, finish;
    eviction, span eviction and reset run in between."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(24, B)
        self.cache = RadixCache(self.pool)
        self.holders: list[Holder] = []
        self.kv: dict[int, tuple] = {}  # slot -> (namespace, path) it was computed from

    @rule(ns=st.sampled_from([None, "a", "b"]),
          tokens=st.lists(st.integers(0, 2), min_size=1, max_size=20))
    def admit(self, ns: str | None, tokens: list[int]) -> None:
        """As the scheduler does: share each whole cached block in place, give every partly
        covered or mixed block a fresh one (its matched tokens copied), then grow."""
        pool, cache = self.pool, self.cache
        m = cache.match(ns, tokens)
        cache.lock(m.node)
        table: list[int] = []
        shared: set[int] = set()
        for k in range(pool.blocks_for(m.length)):
            chunk = m.slots[k * B : (k + 1) * B]
            blk = chunk[0] // B
            if len(chunk) == B and chunk == list(range(blk * B, blk * B + B)):
                pool.incref([blk])
                table.append(blk)
                shared.add(blk)
                continue
            if pool.num_free < 1:
                cache.evict(1)
            if pool.num_free < 1:
                pool.decref(table)
                cache.unlock(m.node)
                return
            table += pool.allocate(1)
        need = pool.blocks_for(len(tokens)) - len(table)
        if pool.num_free < need:
            cache.evict(need - pool.num_free)
        if pool.num_free < need:
            pool.decref(table)
            cache.unlock(m.node)
            return
        table += pool.allocate(need)
        slots = pool.slots(table, 0, len(tokens))
        # copies + newly computed KV, never into shared blocks
        own = [(p, s) for p, s in enumerate(slots) if s // B not in shared]
        for p, s in own:
            self.kv[s] = (ns, tuple(tokens[: p + 1]))
        assert all(self.kv[s] == (ns, tuple(tokens[: p + 1])) for p, s in enumerate(slots))
        node = cache.insert(ns, tokens, slots).node
        cache.lock(node)
        cache.unlock(m.node)
        self.holders.append(Holder(ns, tokens, table, node))

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        h = self.holders.pop(data.draw(st.integers(0, len(self.holders) - 1)))
        self.cache.unlock(h.node)
        self.pool.decref(h.table)

    @rule(n=st.integers(0, 8))
    def evict(self, n: int) -> None:
        self.cache.evict(n)

    @rule(ns=st.sampled_from([None, "a", "b"]),
          tokens=st.lists(st.integers(0, 2), min_size=1, max_size=20), data=st.data())
    def evict_span(self, ns: str | None, tokens: list[int], data: st.DataObject) -> None:
        start = data.draw(st.integers(0, len(tokens) - 1))
        keep = {(n.namespace, tuple(self.cache._path_tokens(n)), tuple(n.slots))
                for space in self.cache.namespaces for n in self.cache.nodes(space)}
        self.cache.evict_span(ns, tokens, start)
        assert self.cache.match(ns, [*tokens, 0]).length <= start
        # Nothing off the evicted path changed its slots (a split only partitions a node).
        after = {}
        for space in self.cache.namespaces:
            for n in self.cache.nodes(space):
                path = tuple(self.cache._path_tokens(n))
                for j, s in enumerate(n.slots):
                    after[(space, path[: n.depth + j + 1])] = s
        for space, path, slots in keep:
            for j, s in enumerate(slots):
                prefix = path[: len(path) - len(slots) + j + 1]
                evicted = space == ns and len(prefix) > start and list(prefix[: start + 1]) == \
                    tokens[: start + 1]
                if not evicted:
                    assert after.get((space, prefix)) == s

    @rule()
    def reset(self) -> None:
        locked = any(attached_lock(h.node) for h in self.holders)
        assert self.cache.reset() != locked

    @invariant()
    def integrity(self) -> None:
        refs: dict[int, int] = {}
        for h in self.holders:
            for b in h.table:
                refs[b] = refs.get(b, 0) + 1
        self.cache.check_integrity([h.node for h in self.holders], refs)
        for space in self.cache.namespaces:
            for n in self.cache.nodes(space):
                path = tuple(self.cache._path_tokens(n))
                for j, s in enumerate(n.slots):
                    assert self.kv[s] == (space, path[: n.depth + j + 1]), "stale KV in cache"


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=120, stateful_step_count=30, deadline=None)


def test_a_shared_block_after_a_mixed_one_keeps_its_place() -> None:
    """Found by the state machine: a path cached as [partly one block, partly another] then
    a whole block; the whole block is shared at logical index 1, the mixed one copied."""
    machine = CacheMachine()
    for tokens in ([0], [0] * 8, [0] * 9):
        machine.admit(None, tokens)
        machine.integrity()
    machine.teardown()
