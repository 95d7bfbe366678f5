"""TieredKV: KV residency under the radix cache — device pool → host RAM → disk.

The device pool (the radix cache's blocks) is the only tier attention reads. When the radix
cache evicts a leaf, the full blocks ending in it are **demoted** (`demote`, called before the
blocks return to the pool) into the host tier while it has room; the host tier's victims move
on to the disk tier, the disk tier's are deleted. When a request is admitted, the full blocks
that follow its device-resident prefix are looked up block by block in the host, then the disk
tier and **promoted** (`promote`: copied into fresh pool blocks and inserted into the radix
cache) before the request runs. Copies are inclusive: a promoted block keeps its lower-tier
copy until that tier evicts it.

Keys are the salted chain digests of native_engine.kvcache.block_hash, computed from the
request's own namespace and tokens, so a block is only ever found by the namespace that stored
it (SEC-8) and a lookup that finds a digest also re-checks parent and tokens (disk: payload
checksum too; a failed check is a miss and deletes the file).

A tier is used only while its measured restore beats recompute (policies.eviction.restore_pays
with the start-up rates); otherwise blocks are not demoted into it and never restored from it.
Victims within a tier follow policies.eviction's value-aware order with the tier's restore
cost; blocks of retired namespaces (an old salt epoch) go first and are not moved down.

Quarantine: `remove_span` removes a span's block and everything derived from it (by parent
digest, across tiers) from every tier, files included, and reports per tier what it removed
and what it could not; `clear` empties every tier.

Events: BlockStored / BlockRemoved with medium "CPU" or "DISK" (as vLLM's offloading connector
names its media), in the order things happen: a demoted block is stored below before it is
removed above. Disk blocks found at start-up are announced once, without extra keys (their
salt is never on disk, so a subscriber keeps their namespace uncertain until it sees a parent).

Invariants (check_integrity): each tier's own invariants; host entries are attributed; every
entry is one full block of the layout.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from native_engine.kvcache.block_hash import NONE_HASH, chain_digests, namespace_extra_keys
from native_engine.kvcache.disk_tier import HEADER_ALLOWANCE, DiskTier, KVLayout
from native_engine.kvcache.host_tier import HostTier
from native_engine.kvcache.tier_entry import (
    MEDIUM_CPU,
    MEDIUM_DISK,
    TierEntry,
    first_block_keys,
    is_root_of,
    tokens_match,
)
from native_engine.kvcache.tier_types import (
    KVAccess,
    PromotableRequest,
    TierConfig,
    TierCounters,
    TierEventSink,
    TierRemoval,
    TierStats,
)
from policies.eviction import (
    EvictionCandidate,
    choose_victims,
    restore_cost_tokens,
    restore_pays,
)

if TYPE_CHECKING:
    from native_engine.kvcache.radix_cache import RadixCache

log = logging.getLogger(__name__)

MEDIA = (MEDIUM_CPU, MEDIUM_DISK)
RETIRED_LAST_USE = -(1 << 62)


@dataclass(slots=True)
class _Restore:
    medium: str
    entry: TierEntry
    kv: torch.Tensor


@dataclass(slots=True)
class _Stored:
    """Blocks one tier gained in one operation, announced as chains."""

    medium: str
    entries: list[TierEntry] = field(default_factory=list)


class TieredKV:
    def __init__(self, config: TierConfig, layout: KVLayout, kv: KVAccess,
                 events: TierEventSink | None = None, root: bytes = NONE_HASH) -> None:
        self.config = config
        self.layout = layout
        self.block_size = layout.block_size
        self.kv = kv
        self.events = events
        self.root = root
        self.rates = config.rates
        self.host = (HostTier(config.host_blocks, layout.block_shape, layout.torch_dtype,
                              config.pin_memory) if config.host_blocks > 0 else None)
        self.disk = (DiskTier(config.disk_dir, layout, config.disk_bytes)
                     if config.disk_dir is not None else None)
        self.pays = {m: restore_pays(self.block_size, layout.block_bytes, m, self.rates)
                     for m in MEDIA}
        self.counters = {m: TierCounters() for m in MEDIA}
        self._retired: set[str | None] = set()
        self._tick = 0
        if self.disk is not None and self.disk.found_at_start:
            self._announce(_Stored(MEDIUM_DISK, self.disk.found_at_start))

    @property
    def empty(self) -> bool:
        return not (self.host is not None and len(self.host)) and \
            not (self.disk is not None and len(self.disk))

    # -- digests --------------------------------------------------------------------------

    def chain(self, namespace: str | None, tokens: Sequence[int], num_blocks: int,
              memo: list[bytes] | None = None) -> list[bytes]:
        """Digests of the first `num_blocks` full blocks; `memo` (a request's, extended in
        place) holds digests already computed for the same tokens."""
        done = memo if memo is not None else []
        if len(done) < num_blocks:
            bs, first = self.block_size, len(done)
            keys = namespace_extra_keys(namespace, first, num_blocks - first)
            done.extend(chain_digests(done[-1] if done else None,
                                      tokens[first * bs:num_blocks * bs], bs, keys,
                                      root=self.root))
        return done[:num_blocks]

    # -- demotion (radix cache eviction) --------------------------------------------------

    def demote(self, namespace: str | None, tokens: Sequence[int], first_block: int,
               slots: Sequence[int]) -> None:
        """Keep the full blocks [first_block, len(tokens) // B) of the path `tokens`, whose KV
        is in `slots` (one per token of those blocks), before the pool drops them."""
        target = self._demotion_target()
        if target is None or namespace in self._retired:
            return
        self._reap()
        bs = self.block_size
        stop = len(tokens) // bs
        digests = self.chain(namespace, tokens, stop)
        self._tick += 1
        for digest in digests[first_block:stop]:
            self._touch(digest)
        # A block already in the target tier stays as it is; one only on disk is copied up
        # into host RAM again (it was just in use).
        held = self.host if target == MEDIUM_CPU else self.disk
        assert held is not None
        fresh = [k for k in range(first_block, stop) if digests[k] not in held]
        if not fresh:
            return
        index = torch.tensor([slots[(k - first_block) * bs + j] for k in fresh
                              for j in range(bs)], dtype=torch.int64)
        kv = self.kv.read_kv(index).split(bs, dim=2)
        entries = [TierEntry(digests[k], digests[k - 1] if k else None,
                             tuple(tokens[k * bs:(k + 1) * bs]), namespace, True,
                             self.layout.block_bytes, last_use=self._tick) for k in fresh]
        if target == MEDIUM_CPU:
            self._to_host(entries, list(kv))
        else:
            self._to_disk(entries, list(kv))

    def _reap(self) -> None:
        """Forget disk blocks whose background write failed."""
        if self.disk is not None:
            self._announce_removed(MEDIUM_DISK, self.disk.reap())

    def drain(self) -> None:
        """Wait until every block queued for the disk is written."""
        if self.disk is not None:
            self.disk.drain()
            self._reap()

    def close(self) -> None:
        """Finish the disk writes and stop the writer (engine shutdown)."""
        if self.disk is not None:
            self.disk.close()
            self._reap()

    def _demotion_target(self) -> str | None:
        if self.host is not None and self.pays[MEDIUM_CPU]:
            return MEDIUM_CPU
        if self.disk is not None and self.pays[MEDIUM_DISK]:
            return MEDIUM_DISK
        return None

    def _touch(self, digest: bytes) -> None:
        """Mark a block held below as used now."""
        for tier in self._tiers():
            entry = tier.get(digest)
            if entry is not None:
                entry.last_use = self._tick

    def _to_host(self, entries: list[TierEntry], kvs: list[torch.Tensor]) -> None:
        host = self.host
        assert host is not None
        protect = {e.digest for e in entries}
        self._make_host_room(len(entries) - host.num_free, protect)
        stored = _Stored(MEDIUM_CPU)
        overflow: list[tuple[TierEntry, torch.Tensor]] = []
        for entry, kv in zip(entries, kvs, strict=True):
            if host.num_free == 0:
                overflow.append((entry, kv))
                continue
            host.put(entry, kv)
            self._count_demotion(MEDIUM_CPU, host.block_bytes)
            stored.entries.append(entry)
        self._announce(stored)
        if overflow and self.disk is not None and self.pays[MEDIUM_DISK]:
            self._to_disk([e for e, _ in overflow], [kv for _, kv in overflow])

    def _make_host_room(self, blocks: int, protect: set[bytes]) -> None:
        host = self.host
        assert host is not None
        if blocks <= 0:
            return
        victims = self._victims(host.entries(), MEDIUM_CPU, blocks * host.block_bytes, protect)
        down = [host.get(d) for d in victims]
        moving = [e for e in down if e is not None and self._worth_moving_down(e)]
        if moving:
            self._to_disk([TierEntry(e.digest, e.parent, e.token_ids, e.namespace, True,
                                     e.nbytes, e.hits, e.last_use) for e in moving],
                          [host.kv(e.digest) for e in moving])
        removed = [d for d in victims if host.remove(d) is not None]
        self._announce_removed(MEDIUM_CPU, removed)

    def _worth_moving_down(self, entry: TierEntry) -> bool:
        return (self.disk is not None and self.pays[MEDIUM_DISK]
                and entry.namespace not in self._retired and entry.digest not in self.disk)

    def _to_disk(self, entries: list[TierEntry], kvs: list[torch.Tensor]) -> None:
        disk = self.disk
        assert disk is not None
        per_file = self.layout.block_bytes + HEADER_ALLOWANCE
        self._make_disk_room(len(entries) * per_file, {e.digest for e in entries})
        stored = _Stored(MEDIUM_DISK)
        for entry, kv in zip(entries, kvs, strict=True):
            if disk.nbytes + per_file > disk.capacity_bytes:
                break
            if disk.write(entry, kv):  # queued; the writer thread makes it durable
                self._count_demotion(MEDIUM_DISK, entry.nbytes)
                stored.entries.append(entry)
        self._announce(stored)

    def _make_disk_room(self, nbytes: int, protect: set[bytes]) -> None:
        disk = self.disk
        assert disk is not None
        need = disk.nbytes + nbytes - disk.capacity_bytes
        if need <= 0:
            return
        removed = []
        for digest in self._victims(disk.entries(), MEDIUM_DISK, need, protect):
            error = disk.remove(digest)
            if error:
                log.error("disk tier eviction: %s", error)
            else:
                removed.append(digest)
        self._announce_removed(MEDIUM_DISK, removed)

    def _victims(self, entries: list[TierEntry], medium: str, nbytes: int,
                 protect: set[bytes]) -> list[bytes]:
        bs = self.block_size
        retired = self._retired
        # Newest first: on equal value and last use, ties go to input order, so a chain
        # demoted together loses its deepest blocks first and stays restorable from its head.
        candidates = [
            EvictionCandidate(
                e.digest, bs, e.nbytes, 0 if e.namespace in retired and e.attributed else e.hits,
                RETIRED_LAST_USE if e.namespace in retired and e.attributed else e.last_use,
                pinned=e.digest in protect,
                restore_cost=min(restore_cost_tokens(e.nbytes, medium, self.rates), bs))
            for e in reversed(entries)]
        return list(choose_victims(candidates, nbytes).victims)  # type: ignore[arg-type]

    def _count_demotion(self, medium: str, nbytes: int) -> None:
        c = self.counters[medium]
        c.demotions += 1
        c.bytes_written += nbytes

    # -- promotion (admission) ------------------------------------------------------------

    def promote(self, cache: RadixCache, req: PromotableRequest) -> int:
        """Bring the lower-tier blocks that continue `req`'s device-resident prefix into the
        pool and the radix cache; returns the tokens that became device-resident."""
        if self.empty:
            return 0
        self._reap()
        bs, tokens = self.block_size, req.token_ids
        limit = (len(tokens) - 1) // bs  # the last prompt token is always computed
        if req.cache_limit is not None:
            limit = min(limit, req.cache_limit // bs)
        match = cache.match(req.namespace, tokens, touch=False)
        first = match.length // bs
        if first >= limit:
            return 0
        digests = self.chain(req.namespace, tokens, limit, req.block_digests)
        restores = self._fetch(digests, tokens, first, limit)
        if not restores:
            return 0
        # One copy, before allocating: eviction may demote into the host rows read here.
        kv = torch.cat([r.kv for r in restores], dim=2)
        cache.lock(match.node)
        try:
            blocks = self._allocate(cache, len(restores))
            if not blocks:
                return 0
            restores = restores[:len(blocks)]
            slots = [b * bs + j for b in blocks for j in range(bs)]
            self.kv.write_kv(torch.tensor(slots, dtype=torch.int64), kv[:, :, :len(slots)])
            end = (first + len(restores)) * bs
            fresh = slots[match.length - first * bs:]
            inserted = cache.insert(req.namespace, tokens[:end], [*match.slots, *fresh])
            assert inserted.existing == match.length, "promotion raced the radix cache"
            cache.pool.decref(blocks)  # the radix cache holds what it uses
        finally:
            cache.unlock(match.node)
        for r in restores:
            c = self.counters[r.medium]
            c.promotions += 1
            c.bytes_read += r.entry.nbytes
        return end - match.length

    def _fetch(self, digests: list[bytes], tokens: Sequence[int], first: int,
               limit: int) -> list[_Restore]:
        """The verified KV of blocks first, first + 1, ... while a tier that pays has them."""
        bs = self.block_size
        self._tick += 1
        found: list[_Restore] = []
        for k in range(first, limit):
            parent = digests[k - 1] if k else None
            block = tuple(tokens[k * bs:(k + 1) * bs])
            restore = self._fetch_one(digests[k], parent, block)
            if restore is None:
                break
            restore.entry.hits += 1
            restore.entry.last_use = self._tick
            self.counters[restore.medium].hits += 1
            found.append(restore)
        return found

    def _fetch_one(self, digest: bytes, parent: bytes | None,
                   block: tuple[int, ...]) -> _Restore | None:
        host, disk = self.host, self.disk
        if host is not None and self.pays[MEDIUM_CPU] and (entry := host.get(digest)):
            if tokens_match(entry, parent, block):
                return _Restore(MEDIUM_CPU, entry, host.kv(digest))
            self.counters[MEDIUM_CPU].restore_failures += 1
            log.error("host tier block %s does not match its digest; dropped", digest.hex()[:16])
            host.remove(digest)
            self._announce_removed(MEDIUM_CPU, [digest])
        if disk is not None and self.pays[MEDIUM_DISK] and (entry := disk.get(digest)):
            kv = disk.read(digest, parent, block)
            if kv is not None:
                return _Restore(MEDIUM_DISK, entry, kv)
            if digest not in disk:  # rejected and deleted
                self._announce_removed(MEDIUM_DISK, [digest])
        return None

    def _allocate(self, cache: RadixCache, n: int) -> list[int]:
        pool = cache.pool
        if pool.num_free < n:
            cache.evict(n - pool.num_free)
        n = min(n, pool.num_free)
        return pool.allocate(n) if n else []

    # -- quarantine -----------------------------------------------------------------------

    def remove_span(self, namespace: str | None, tokens: Sequence[int],
                    start: int) -> list[TierRemoval]:
        """Remove from every tier the block holding position `start` of the path `tokens` in
        `namespace`, and every block derived from it. Blocks are whole, so the tokens of that
        block before `start` go too (the device tree keeps them)."""
        self._reap()
        doomed = self._derived(namespace, tokens, start)
        results = []
        for tier in self._tiers():
            removed = frozenset(d for d in doomed if d in tier)
            errors: list[str] = []
            if isinstance(tier, DiskTier):
                errors = [e for e in map(tier.remove, sorted(removed)) if e]
                gone = sorted(d for d in removed if not tier.path_of(d).exists())
            else:
                for digest in removed:
                    tier.remove(digest)
                gone = sorted(removed)
            self._announce_removed(tier.medium, gone)
            left = self._derived(namespace, tokens, start) & {e.digest for e in tier.entries()}
            if isinstance(tier, DiskTier):
                left |= {d for d in removed if tier.path_of(d).exists()}
            results.append(TierRemoval(tier.medium, removed, len(left), tuple(errors)))
        return results

    def _derived(self, namespace: str | None, tokens: Sequence[int], start: int) -> set[bytes]:
        bs = self.block_size
        k = start // bs
        prefix = self.chain(namespace, tokens, k)
        parent = prefix[-1] if k else None
        head = tuple(tokens[k * bs:start + 1])
        frontier = [d for tier in self._tiers() for d in tier.children.of(parent)
                    if self._derives(tier.get(d), namespace, head)]
        doomed: set[bytes] = set()
        while frontier:
            digest = frontier.pop()
            if digest in doomed:
                continue
            doomed.add(digest)
            frontier.extend(d for tier in self._tiers() for d in tier.children.of(digest))
        return doomed

    def _derives(self, entry: TierEntry | None, namespace: str | None,
                 head: tuple[int, ...]) -> bool:
        if entry is None or entry.token_ids[:len(head)] != head:
            return False
        return entry.parent is not None or is_root_of(entry, namespace, self.root)

    def clear(self) -> list[TierRemoval]:
        """Empty every tier (a whole-prefix flush; the caller publishes AllBlocksCleared)."""
        results = []
        if self.host is not None:
            gone = self.host.clear()
            results.append(TierRemoval(MEDIUM_CPU, frozenset(e.digest for e in gone),
                                       len(self.host)))
        if self.disk is not None:
            gone, errors = self.disk.clear()
            left = sum(1 for _ in self.disk.directory.iterdir())
            results.append(TierRemoval(MEDIUM_DISK, frozenset(e.digest for e in gone),
                                       left + len(self.disk), tuple(errors)))
        return results

    def retire(self, namespace: str | None) -> None:
        """An old salt epoch: its blocks can never match again, so they are evicted first
        and never moved to a lower tier."""
        self._retired.add(namespace)

    # -- views ----------------------------------------------------------------------------

    def _tiers(self) -> list[HostTier | DiskTier]:
        return [t for t in (self.host, self.disk) if t is not None]

    def resident(self) -> dict[str, frozenset[bytes]]:
        """medium -> digests held (quarantine evidence snapshots)."""
        return {t.medium: frozenset(e.digest for e in t.entries()) for t in self._tiers()}

    def stats(self) -> tuple[TierStats, ...]:
        out = []
        for tier in self._tiers():
            c = self.counters[tier.medium]
            capacity = (tier.capacity * tier.block_bytes if isinstance(tier, HostTier)
                        else tier.capacity_bytes)
            failures = tier.rejected if isinstance(tier, DiskTier) else c.restore_failures
            out.append(TierStats(
                tier.medium, len(tier), tier.nbytes, capacity, c.hits, c.promotions,
                c.demotions, failures, c.bytes_written, c.bytes_read,
                self.rates.restore_bytes_per_s.get(tier.medium), self.pays[tier.medium],
                self.rates.prefill_tokens_per_s))
        return tuple(out)

    # -- events ---------------------------------------------------------------------------

    def _announce(self, stored: _Stored) -> None:
        """BlockStored per chain of consecutive entries (each entry's parent the previous)."""
        if self.events is None or not stored.entries:
            return
        run: list[TierEntry] = []
        for entry in stored.entries:
            if run and entry.parent != run[-1].digest:
                self._emit_run(stored.medium, run)
                run = []
            run.append(entry)
        self._emit_run(stored.medium, run)

    def _emit_run(self, medium: str, run: list[TierEntry]) -> None:
        """Extra keys as the device pool's events carry them; none at all for a chain whose
        root's salt is unknown (a disk block found at start-up)."""
        assert self.events is not None
        head = run[0]
        keys = None
        if head.parent is not None or head.attributed:
            keys = [first_block_keys(e.namespace) if e.parent is None else None for e in run]
        self.events.on_tier_stored(medium, [e.digest for e in run], head.parent,
                                   [t for e in run for t in e.token_ids], self.block_size, keys)

    def _announce_removed(self, medium: str, digests: list[bytes]) -> None:
        if self.events is not None and digests:
            self.events.on_tier_removed(medium, list(digests))

    def check_integrity(self) -> None:
        for tier in self._tiers():
            tier.check_integrity()
        if self.host is not None:
            assert all(e.attributed for e in self.host.entries()), "host entry without salt"
