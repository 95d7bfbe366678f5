"""RadixCache: token-level prefix tree over paged KV (docs/design.md §5, §6).

Each namespace (a cache salt, or None) has its own root, so tenants never share a node. A node
holds a run of tokens and, per token, the KV slot it lives in; a token at depth p always sits at
offset p % B of its block, because it was written there by a request at position p. The tree
holds one pool reference on every block that any of its slots lies in (counted per block), so
a block returns to the pool only when no node and no request uses it. Blocks are written once
per position by the request that allocated them and never rewritten, so sharing is safe.

Invariants (checked by `check_integrity`): parent/child links, depths and first-token keys
agree; every node's namespace is its root's; slots are unique across the tree and aligned to
their depth; the per-block token counts match the slots; the leaf set is exact; a node's
lock_ref equals the number of lock holders at or below it; each cache group's block count is
the number of distinct blocks its namespaces' nodes hold.

Capacity isolation (SEC-9): a namespace may belong to a cache group (the tenant) with a
reserved number of blocks (`reserve`). Eviction on behalf of another group never takes a
group's blocks while that group holds no more than its reservation, so a flood by one
tenant cannot evict another below its share; a group evicts its own blocks freely.

Eviction takes unlocked leaves, chosen by `choose_victims` (by default policies.eviction's
value-aware order, which is LRU on uniform inputs); with a `demoter` (the lower KV tiers,
native_engine.kvcache.tiers) each victim's full blocks are handed down before their pool
references go. `evict_span` and `reset` never demote. `evict_span` cuts the tree at a position
regardless of locks: running requests keep their own block references, the cache just stops
offering the span.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from native_engine.kvcache.block_pool import BlockPool
from policies.eviction import EvictionCandidate, choose_victims


class Node:
    __slots__ = (
        "children",
        "depth",
        "detached",
        "hit_count",
        "last_access",
        "lock_ref",
        "namespace",
        "parent",
        "slots",
        "tokens",
    )

    def __init__(
        self,
        namespace: str | None,
        parent: Node | None,
        tokens: list[int],
        slots: list[int],
        depth: int,
    ) -> None:
        self.namespace = namespace
        self.parent = parent
        self.tokens = tokens
        self.slots = slots
        self.depth = depth  # position of tokens[0] in the sequence
        self.children: dict[int, Node] = {}
        self.lock_ref = 0
        self.last_access = 0
        self.hit_count = 0
        self.detached = False

    @property
    def end(self) -> int:
        return self.depth + len(self.tokens)


@dataclass(frozen=True, slots=True)
class MatchResult:
    """`length` leading tokens are cached in `slots`; `node` ends exactly at `length`."""

    length: int
    slots: list[int]
    node: Node | None


@dataclass(frozen=True, slots=True)
class InsertResult:
    """`existing` leading tokens were already cached; `node` ends at the inserted length."""

    existing: int
    node: Node | None


class CacheEventListener(Protocol):
    """Told about every full block (B tokens at positions [kB, (k+1)B) of one path) that becomes
    or stops being cached. Hashes chain from the first block, which folds in the namespace."""

    def on_blocks_stored(
        self,
        namespace: str | None,
        block_hashes: list[int],
        parent_block_hash: int | None,
        token_ids: list[int],
        block_size: int,
    ) -> None: ...

    def on_blocks_removed(self, namespace: str | None, block_hashes: list[int]) -> None: ...

    def on_cleared(self) -> None: ...

    def flush(self) -> int | None:
        """Publish what the notifications since the last flush described, as one batch.
        The engine calls it once per step and after evict_span and reset."""
        ...


class Demoter(Protocol):
    """Keeps what eviction would drop (native_engine.kvcache.tiers.TieredKV)."""

    def demote(self, namespace: str | None, tokens: Sequence[int], first_block: int,
               slots: Sequence[int]) -> None:
        """Full blocks [first_block, len(tokens) // B) of the path `tokens` leave the pool;
        `slots` holds their KV, one slot per token of those blocks."""
        ...


VictimChooser = Callable[[Sequence[Node], int], Sequence[Node]]
"""(evictable leaves, tokens wanted) -> leaves to drop, in order."""


def value_victims(candidates: Sequence[Node], tokens_needed: int) -> list[Node]:
    """Design §3's value-aware order (policies.eviction): cheapest recompute-cost × reuse
    probability per byte first, ties to the least recently used. KV bytes are proportional
    to tokens, so a node's size is counted in tokens."""
    choice = choose_victims(
        [
            EvictionCandidate(n, len(n.tokens), len(n.tokens), n.hit_count, n.last_access)
            for n in candidates
        ],
        tokens_needed,
    )
    return list(choice.victims)  # type: ignore[arg-type]


def lru_victims(candidates: Sequence[Node], tokens_needed: int) -> list[Node]:
    """Least recently used first."""
    return sorted(candidates, key=lambda n: n.last_access)


def block_hash(parent: int | None, tokens: Sequence[int], namespace: str | None) -> int:
    """uint64 id of a full block: sha256 over the parent id, the namespace (first block only)
    and the token ids."""
    h = hashlib.sha256()
    if parent is None:
        salt = b"" if namespace is None else namespace.encode()
        h.update(b"\x00" + len(salt).to_bytes(4, "big") + salt)
    else:
        h.update(b"\x01" + parent.to_bytes(8, "big"))
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest()[:8], "big")


def chain_hashes(namespace: str | None, tokens: Sequence[int], block_size: int) -> list[int]:
    """Hashes of every full block of `tokens`."""
    hashes: list[int] = []
    parent = None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[start : start + block_size], namespace)
        hashes.append(parent)
    return hashes


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class RadixCache:
    def __init__(
        self,
        pool: BlockPool,
        listener: CacheEventListener | None = None,
        choose_victims: VictimChooser = value_victims,
        demoter: Demoter | None = None,
    ) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.listener = listener
        self.choose_victims = choose_victims
        self.demoter = demoter
        self._roots: dict[str | None, Node] = {}
        self._leaves: set[Node] = set()
        self._block_tokens: dict[int, int] = {}  # block -> tree slots in it
        self._group_of: dict[str | None, str] = {}  # namespace -> cache group
        self._reserved: dict[str, int] = {}  # cache group -> blocks it keeps
        self._group_blocks: dict[str, int] = {}  # cache group -> blocks the tree holds for it
        self._tick = 0
        self.num_tokens = 0

    # -- lookup -------------------------------------------------------------------------

    def match(self, namespace: str | None, tokens: Sequence[int],
              touch: bool = True) -> MatchResult:
        """Longest cached prefix of `tokens`, never all of it (at most len - 1 tokens), so the
        last token is always computed. Splits a node so the match ends on a node boundary.
        `touch` False looks without counting a use (no hit, no recency)."""
        root = self._roots.get(namespace)
        limit = len(tokens) - 1
        if root is None or limit <= 0:
            return MatchResult(0, [], root)
        if touch:
            self._tick += 1
        node, i, slots = root, 0, []
        while i < limit:
            child = node.children.get(tokens[i])
            if child is None:
                break
            k = _common_prefix(child.tokens, tokens[i:limit])
            if k < len(child.tokens):
                child = self.split(child, k)
            if touch:
                child.last_access = self._tick
                child.hit_count += 1
            slots.extend(child.slots)
            node, i = child, i + k
        return MatchResult(i, slots, node)

    def lock(self, node: Node | None) -> None:
        """Protect `node` and its ancestors from eviction (not from `evict_span`)."""
        while node is not None and node.parent is not None:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node | None) -> None:
        while node is not None and node.parent is not None:
            if node.lock_ref <= 0:
                raise RuntimeError("unlock of an unlocked radix node")
            node.lock_ref -= 1
            node = node.parent

    # -- insertion ----------------------------------------------------------------------

    def insert(
        self, namespace: str | None, tokens: Sequence[int], slots: Sequence[int],
        group: str | None = None,
    ) -> InsertResult:
        """Cache `tokens` whose KV is in `slots`. Tokens already cached keep their slots (the
        caller's duplicates stay the caller's); the rest become a new leaf. `group` names
        the cache group the namespace belongs to (capacity isolation)."""
        if len(tokens) != len(slots):
            raise ValueError("tokens and slots differ in length")
        if group is not None and namespace not in self._group_of:
            self._group_of[namespace] = group
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = Node(namespace, None, [], [], 0)
        self._tick += 1
        node, i = root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            k = _common_prefix(child.tokens, tokens[i:])
            if k < len(child.tokens):
                child = self.split(child, k)
            child.last_access = self._tick
            node, i = child, i + k
        existing = i
        if i < len(tokens):
            node = self._add_leaf(node, list(tokens[i:]), list(slots[i:]))
            if self.listener is not None:
                self._emit_stored(node, tokens)
        return InsertResult(existing, None if node is root else node)

    def split(self, node: Node, k: int) -> Node:
        """Cut `node` after its first k tokens; returns the new upper node."""
        if not 0 < k < len(node.tokens):
            raise ValueError(f"cannot split a {len(node.tokens)}-token node at {k}")
        parent = node.parent
        assert parent is not None
        upper = Node(node.namespace, parent, node.tokens[:k], node.slots[:k], node.depth)
        upper.lock_ref, upper.last_access = node.lock_ref, node.last_access
        upper.hit_count = node.hit_count
        parent.children[upper.tokens[0]] = upper
        node.tokens, node.slots = node.tokens[k:], node.slots[k:]
        node.depth += k
        node.parent = upper
        upper.children[node.tokens[0]] = node
        return upper

    def _add_leaf(self, parent: Node, tokens: list[int], slots: list[int]) -> Node:
        leaf = Node(parent.namespace, parent, tokens, slots, parent.end)
        leaf.last_access = self._tick
        parent.children[tokens[0]] = leaf
        self._leaves.discard(parent)
        self._leaves.add(leaf)
        self._hold(slots, leaf.namespace)
        return leaf

    # -- eviction -----------------------------------------------------------------------

    def evict(self, num_blocks: int, group: str | None = None) -> int:
        """Drop unlocked leaves (policy order) until `num_blocks` blocks returned to the pool or
        nothing is evictable, on behalf of cache group `group`: another group at or below its
        reservation is never a victim. Returns blocks freed (it may free more than asked)."""
        start_free = self.pool.num_free
        while self.pool.num_free - start_free < num_blocks:
            candidates = [n for n in self._leaves
                          if n.lock_ref == 0 and not self._protected(n, group)]
            if not candidates:
                break
            needed = num_blocks - (self.pool.num_free - start_free)
            for victim in self.choose_victims(candidates, needed * self.block_size):
                if self._protected(victim, group):
                    continue  # its group reached its reservation during this round
                if self.demoter is not None:
                    self._demote(victim)
                self._remove_leaf(victim)
                if self.pool.num_free - start_free >= num_blocks:
                    break
        return self.pool.num_free - start_free

    def reserve(self, group: str, blocks: int) -> None:
        """Keep `blocks` of the tree's blocks for cache group `group` (0 lifts it)."""
        if blocks < 0:
            raise ValueError("a reservation is a number of blocks >= 0")
        self._reserved[group] = blocks

    def group_blocks(self, group: str) -> int:
        return self._group_blocks.get(group, 0)

    def _protected(self, node: Node, group: str | None) -> bool:
        """Evicting `node` for `group` would take its owner group below its reservation."""
        owner = self._group_of.get(node.namespace)
        reserved = self._reserved.get(owner, 0) if owner is not None else 0
        if owner is None or owner == group or reserved == 0:
            return False
        return self._group_blocks.get(owner, 0) - self._freed_by(node) < reserved

    def _freed_by(self, node: Node) -> int:
        """Blocks that leave the tree if `node` goes (no other node has slots in them)."""
        per_block: dict[int, int] = {}
        for s in node.slots:
            per_block[s // self.block_size] = per_block.get(s // self.block_size, 0) + 1
        return sum(1 for b, n in per_block.items() if self._block_tokens.get(b) == n)

    def evict_span(self, namespace: str | None, tokens: Sequence[int], start: int) -> int:
        """Evict the KV of span [start, len(tokens)) on the path `tokens`, with every cached
        continuation that shares tokens[:start + 1]; tokens < start and other paths stay.
        Locks do not protect a span. Returns the number of cached tokens removed."""
        if not 0 <= start < len(tokens):
            raise ValueError(f"span start {start} outside [0, {len(tokens)})")
        root = self._roots.get(namespace)
        if root is None:
            return 0
        node, i = root, 0
        while i < start:
            child = node.children.get(tokens[i])
            if child is None:
                return 0
            k = _common_prefix(child.tokens, tokens[i:start])
            if k < len(child.tokens):
                if i + k < start:
                    return 0  # the cached path leaves `tokens` before the span
                child = self.split(child, k)
            node, i = child, i + k
        victim = node.children.get(tokens[start])
        return 0 if victim is None else self._remove_subtree(victim)

    def age_out(self, namespace: str | None) -> None:
        """Make `namespace`'s nodes the first eviction victims (no hits, oldest use)."""
        for node in self.nodes(namespace):
            node.hit_count, node.last_access = 0, 0

    def reset(self) -> bool:
        """Drop every cached node; refused (False, nothing dropped) while any node is locked."""
        tops = [child for root in self._roots.values() for child in root.children.values()]
        if any(child.lock_ref > 0 for child in tops):
            return False
        listener, self.listener = self.listener, None  # one on_cleared, not per-block removals
        try:
            for root in self._roots.values():
                for child in list(root.children.values()):
                    self._remove_subtree(child)
        finally:
            self.listener = listener
        self._roots.clear()
        if listener is not None:
            listener.on_cleared()
        return True

    def _demote(self, node: Node) -> None:
        blocks = self._full_blocks_ending_in(node)
        if not blocks:
            return
        tokens, slots = self._path(node)
        bs = self.block_size
        assert self.demoter is not None
        self.demoter.demote(node.namespace, tokens[: blocks.stop * bs], blocks.start,
                            slots[blocks.start * bs : blocks.stop * bs])

    def _remove_subtree(self, top: Node) -> int:
        removed = 0
        stack, order = [top], []
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        for node in reversed(order):  # children before parents: each is a leaf when removed
            removed += len(node.tokens)
            self._remove_leaf(node)
        return removed

    def _remove_leaf(self, node: Node) -> None:
        parent = node.parent
        assert parent is not None and not node.children
        if self.listener is not None:
            self._emit_removed(node)
        del parent.children[node.tokens[0]]
        self._leaves.discard(node)
        self._release(node.slots, node.namespace)
        node.slots = []
        node.detached = True  # keeps `parent` so holders of a lock can still unlock
        if parent.parent is not None and not parent.children:
            self._leaves.add(parent)

    # -- block references ---------------------------------------------------------------

    def _hold(self, slots: Iterable[int], namespace: str | None) -> None:
        bs = self.block_size
        group = self._group_of.get(namespace)
        for s in slots:
            b = s // bs
            count = self._block_tokens.get(b, 0)
            if count == 0:
                self.pool.incref([b])
                if group is not None:
                    self._group_blocks[group] = self._group_blocks.get(group, 0) + 1
            self._block_tokens[b] = count + 1
            self.num_tokens += 1

    def _release(self, slots: Iterable[int], namespace: str | None) -> None:
        bs = self.block_size
        group = self._group_of.get(namespace)
        for s in slots:
            b = s // bs
            count = self._block_tokens[b] - 1
            self.num_tokens -= 1
            if count == 0:
                del self._block_tokens[b]
                self.pool.decref([b])
                if group is not None:
                    self._group_blocks[group] -= 1
            else:
                self._block_tokens[b] = count

    def held_blocks(self) -> set[int]:
        return set(self._block_tokens)

    # -- events -------------------------------------------------------------------------

    def _path_tokens(self, node: Node) -> list[int]:
        return self._path(node)[0]

    def _path(self, node: Node) -> tuple[list[int], list[int]]:
        """Tokens and slots from the root to the end of `node`."""
        parts = []
        while node is not None and node.parent is not None:
            parts.append(node)
            node = node.parent
        order = parts[::-1]
        return [t for n in order for t in n.tokens], [s for n in order for s in n.slots]

    def _full_blocks_ending_in(self, node: Node) -> range:
        bs = self.block_size
        return range(node.depth // bs, node.end // bs)

    def _emit_stored(self, leaf: Node, path: Sequence[int]) -> None:
        blocks = self._full_blocks_ending_in(leaf)
        if not blocks:
            return
        bs = self.block_size
        hashes = chain_hashes(leaf.namespace, path[: blocks.stop * bs], bs)
        parent = hashes[blocks.start - 1] if blocks.start > 0 else None
        assert self.listener is not None
        self.listener.on_blocks_stored(
            leaf.namespace,
            hashes[blocks.start :],
            parent,
            list(path[blocks.start * bs : blocks.stop * bs]),
            bs,
        )

    def _emit_removed(self, node: Node) -> None:
        blocks = self._full_blocks_ending_in(node)
        if not blocks:
            return
        path = self._path_tokens(node)
        bs = self.block_size
        hashes = chain_hashes(node.namespace, path[: blocks.stop * bs], bs)
        assert self.listener is not None
        self.listener.on_blocks_removed(node.namespace, hashes[blocks.start :])

    # -- integrity ----------------------------------------------------------------------

    def nodes(self, namespace: str | None) -> list[Node]:
        root = self._roots.get(namespace)
        out: list[Node] = []
        stack = list(root.children.values()) if root else []
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    @property
    def namespaces(self) -> list[str | None]:
        return list(self._roots)

    def check_integrity(
        self,
        lock_holders: Iterable[Node | None] | None = None,
        request_refs: Mapping[int, int] | None = None,
    ) -> None:
        """Raise AssertionError on a broken invariant. With `lock_holders` (the node each
        request locked) lock counts must match; with `request_refs` (block -> number of
        request block tables holding it) the pool's refcounts must equal requests + tree."""
        bs = self.block_size
        seen_slots: set[int] = set()
        counts: dict[int, int] = {}
        leaves: set[Node] = set()
        group_blocks: dict[str, set[int]] = {}
        for ns, root in self._roots.items():
            assert root.namespace == ns and root.parent is None and not root.tokens
            for node in self.nodes(ns):
                parent = node.parent
                assert parent is not None and not node.detached
                assert node.namespace == ns, "a node is shared across namespaces"
                assert node.tokens and len(node.tokens) == len(node.slots)
                assert parent.children.get(node.tokens[0]) is node
                assert node.depth == parent.end
                for j, s in enumerate(node.slots):
                    assert s % bs == (node.depth + j) % bs, "slot offset disagrees with depth"
                    assert s not in seen_slots, f"slot {s} held by two nodes"
                    seen_slots.add(s)
                    counts[s // bs] = counts.get(s // bs, 0) + 1
                    if ns in self._group_of:
                        group_blocks.setdefault(self._group_of[ns], set()).add(s // bs)
                if not node.children:
                    leaves.add(node)
        assert counts == self._block_tokens, "per-block token counts drifted"
        assert leaves == self._leaves, "leaf set drifted"
        assert {g: len(b) for g, b in group_blocks.items()} == {
            g: n for g, n in self._group_blocks.items() if n}, "per-group block counts drifted"
        assert self.num_tokens == len(seen_slots)
        if lock_holders is not None:
            self._check_locks(lock_holders)
        if request_refs is not None:
            refs = dict(request_refs)
            for b in self._block_tokens:
                refs[b] = refs.get(b, 0) + 1
            self.pool.check_integrity(refs)

    def _check_locks(self, holders: Iterable[Node | None]) -> None:
        want: dict[Node, int] = {}
        for node in holders:
            while node is not None and node.parent is not None:
                want[node] = want.get(node, 0) + 1
                node = node.parent
        for ns in self._roots:
            for node in self.nodes(ns):
                assert node.lock_ref == want.get(node, 0), "lock_ref disagrees with holders"
