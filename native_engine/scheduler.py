"""Scheduler with vLLM V1 semantics (docs/design.md §6).

Each step spends a token budget (`max_num_batched_tokens`) over at most `max_num_seqs`
requests: running requests first (decodes and unfinished prefill chunks), then waiting ones
(only if no running request was preempted this step). A request's chunk is whatever part of
its tokens still lacks KV, capped by the budget, so prefill chunks, prefix hits, decodes and
recompute after preemption are one mechanism. When blocks run out the cache is evicted first,
then a running request is preempted by recompute: FCFS takes the last admitted, the priority
policy the largest (priority, arrival). Under the priority policy a waiting request with a
strictly lower priority value also preempts the worst running one when it lacks a sequence
slot or blocks.

Admission reuses the longest cached prefix: a block wholly covered by one cached block is
shared (refcount), any partially covered block gets a fresh block whose matched tokens are
copied (`SchedulerOutput.copy_src/copy_dst`, to run before the forward), so every matched
token counts as cached. With lower KV tiers, the blocks that continue the device-resident
prefix are promoted into the pool first (native_engine.kvcache.tiers), so they count too.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from native_engine.config import EngineConfig
from native_engine.kvcache.block_pool import BlockPool
from native_engine.kvcache.radix_cache import MatchResult, RadixCache
from native_engine.kvcache.tiers import TieredKV
from native_engine.request import Request, RequestStatus


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan: `scheduled` (request, number of new tokens) in batch order."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    copy_src: list[int] = field(default_factory=list)
    copy_dst: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


@dataclass(slots=True)
class SchedulerStats:
    """Monotonic counters (prefix counters count every admission, as vLLM's do)."""

    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    num_prefix_queries: int = 0
    num_preemptions: int = 0


class FcfsQueue:
    def __init__(self) -> None:
        self._items: deque[Request] = deque()

    def add(self, req: Request) -> None:
        self._items.append(req)

    def prepend(self, req: Request) -> None:
        self._items.appendleft(req)

    def peek(self) -> Request:
        return self._items[0]

    def pop(self) -> Request:
        return self._items.popleft()

    def remove(self, req: Request) -> None:
        self._items.remove(req)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)


class PriorityQueue:
    """Heap on (priority, arrival_time); a preempted request simply goes back in by its key."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    def add(self, req: Request) -> None:
        heapq.heappush(self._heap, (*req.sort_key, next(self._seq), req))

    prepend = add

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, req: Request) -> None:
        self._heap = [item for item in self._heap if item[3] is not req]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (item[3] for item in sorted(self._heap))


class Scheduler:
    def __init__(self, config: EngineConfig, pool: BlockPool, cache: RadixCache | None,
                 tiers: TieredKV | None = None) -> None:
        self.config = config
        self.pool = pool
        self.cache = cache if config.enable_prefix_caching else None
        self.tiers = tiers if self.cache is not None else None
        self.waiting: FcfsQueue | PriorityQueue = (
            PriorityQueue() if config.scheduling_policy == "priority" else FcfsQueue()
        )
        self.running: list[Request] = []
        self.stats = SchedulerStats()

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.add(req)

    def has_unfinished(self) -> bool:
        return bool(self.running) or bool(self.waiting)

    # -- the step -----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.config.scheduling_policy == "priority":
            self._preempt_for_waiting(out)
        preempted_before = len(out.preempted)
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if len(out.preempted) == preempted_before:  # vLLM: no admissions under memory pressure
            self._schedule_waiting(out, budget)
        return out

    def _chunk(self, req: Request, budget: int) -> int:
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        if self.config.long_prefill_token_threshold:
            n = min(n, self.config.long_prefill_token_threshold)
        return n

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        scheduled: dict[int, int] = {}  # id(req) -> tokens, to undo a preempted one
        idx = 0
        while idx < len(self.running) and budget > 0:
            req = self.running[idx]
            n = self._chunk(req, budget)
            if self._grow(req, req.num_computed_tokens + n):
                scheduled[id(req)] = n
                out.scheduled.append((req, n))
                budget -= n
                idx += 1
                continue
            victim = self._victim()
            if id(victim) in scheduled:
                budget += scheduled.pop(id(victim))
                out.scheduled = [(r, k) for r, k in out.scheduled if r is not victim]
            if self.running.index(victim) < idx:
                idx -= 1
            self._preempt(victim, out)
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.peek()
            n = self._admit(req, budget, out)
            if n == 0:
                break
            self.waiting.pop()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append((req, n))
            budget -= n

    def _preempt_for_waiting(self, out: SchedulerOutput) -> None:
        while self.waiting and self.running:
            head = self.waiting.peek()
            victim = self._victim()
            if victim.priority <= head.priority:
                return
            need = self.pool.blocks_for(min(head.num_tokens, self.config.max_num_batched_tokens))
            if self.pool.num_free < need and self.cache is not None:
                self.cache.evict(need - self.pool.num_free, head.cache_group)
            lacks_seq = len(self.running) >= self.config.max_num_seqs
            if not lacks_seq and self.pool.num_free >= need:
                return
            self._preempt(victim, out)

    # -- blocks -------------------------------------------------------------------------

    def _grow(self, req: Request, num_tokens: int) -> bool:
        """Give `req` blocks for `num_tokens` tokens, evicting cache first; False if short."""
        need = self.pool.blocks_for(num_tokens) - len(req.block_table)
        if need <= 0:
            return True
        if self.pool.num_free < need and self.cache is not None:
            self.cache.evict(need - self.pool.num_free, req.cache_group)
        if self.pool.num_free < need:
            return False
        req.block_table.extend(self.pool.allocate(need))
        return True

    def _admit(self, req: Request, budget: int, out: SchedulerOutput) -> int:
        """Match the prefix, lock it, allocate; returns the chunk size or 0 (state undone)."""
        copies: tuple[list[int], list[int]] = ([], [])
        if self.cache is not None:
            if self.tiers is not None:
                self.tiers.promote(self.cache, req)
            match = self.cache.match(req.namespace, req.token_ids)
            self.cache.lock(match.node)  # before allocating: eviction must not take the hit
            req.cache_node = match.node
            if not self._reuse(req, match, copies):
                self._release(req, insert=False)
                return 0
        n = req.num_tokens - req.num_computed_tokens
        if self.config.long_prefill_token_threshold:
            n = min(n, self.config.long_prefill_token_threshold)
        if n > budget and not self.config.enable_chunked_prefill:
            self._release(req, insert=False)
            return 0
        n = min(n, budget)
        if not self._grow(req, req.num_computed_tokens + n):
            self._release(req, insert=False)
            return 0
        if req.status is RequestStatus.WAITING:
            req.num_cached_tokens = req.num_computed_tokens
        self.stats.num_prefix_queries += 1
        self.stats.prefix_query_tokens += req.num_tokens
        self.stats.prefix_hit_tokens += req.num_computed_tokens
        out.copy_src.extend(copies[0])
        out.copy_dst.extend(copies[1])
        return n

    def _reuse(self, req: Request, match: MatchResult, copies: tuple[list[int], list[int]]) -> bool:
        """Build the block table for the matched prefix: share whole cached blocks, copy the
        tokens of partially covered or mixed blocks into fresh ones."""
        bs = self.pool.block_size
        for k in range(self.pool.blocks_for(match.length)):
            chunk = match.slots[k * bs : (k + 1) * bs]
            block = chunk[0] // bs
            if len(chunk) == bs and chunk == list(range(block * bs, block * bs + bs)):
                self.pool.incref([block])
                req.block_table.append(block)
                continue
            if self.pool.num_free < 1:
                self.cache.evict(1, req.cache_group)  # type: ignore[union-attr]
            if self.pool.num_free < 1:
                return False
            fresh = self.pool.allocate(1)[0]
            req.block_table.append(fresh)
            copies[0].extend(chunk)
            copies[1].extend(range(fresh * bs, fresh * bs + len(chunk)))
        req.num_computed_tokens = match.length
        return True

    # -- lifecycle ----------------------------------------------------------------------

    def advance(self, out: SchedulerOutput) -> None:
        """After the forward: the scheduled tokens now have KV; prefill chunks are cached."""
        for req, n in out.scheduled:
            is_decode = n == 1 and req.num_computed_tokens >= req.num_prompt_tokens
            req.num_computed_tokens += n
            if not is_decode:
                self._cache_computed(req)

    def _victim(self) -> Request:
        if self.config.scheduling_policy == "priority":
            return max(self.running, key=lambda r: r.sort_key)
        return self.running[-1]

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self._release(req, insert=True)
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.prepend(req)
        out.preempted.append(req)

    def finish(self, req: Request, status: RequestStatus, cache: bool = True) -> None:
        """End `req` (running or waiting): cache its computed tokens (unless not `cache`),
        free its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(req)
        self._release(req, insert=cache)
        req.status = status

    def _cache_computed(self, req: Request) -> None:
        if self.cache is None:
            return
        n = req.num_computed_tokens
        if req.cache_limit is not None:
            n = min(n, req.cache_limit)
        if n == 0:
            return
        slots = self.pool.slots(req.block_table, 0, n)
        result = self.cache.insert(req.namespace, req.token_ids[:n], slots, req.cache_group)
        # Move the lock to the deepest node: nodes holding our blocks are pointless to evict.
        self.cache.lock(result.node)
        self.cache.unlock(req.cache_node)
        req.cache_node = result.node

    def _release(self, req: Request, insert: bool) -> None:
        if insert:
            self._cache_computed(req)
        if self.cache is not None:
            self.cache.unlock(req.cache_node)
        req.cache_node = None
        self.pool.decref(req.block_table)
        req.block_table = []
        req.num_computed_tokens = 0

    def request_block_refs(self) -> dict[int, int]:
        refs: dict[int, int] = {}
        for req in self.running:
            for b in req.block_table:
                refs[b] = refs.get(b, 0) + 1
        return refs

    def check_integrity(self) -> None:
        """Waiting requests hold no blocks or locks; running ones hold blocks for their KV;
        pool refcounts equal request holders + cache holders."""
        for req in self.waiting:
            assert not req.block_table and req.cache_node is None and req.num_computed_tokens == 0
        assert len(self.running) <= self.config.max_num_seqs
        for req in self.running:
            assert req.status is RequestStatus.RUNNING
            assert len(req.block_table) >= self.pool.blocks_for(req.num_computed_tokens)
        refs = self.request_block_refs()
        if self.cache is not None:
            self.cache.check_integrity([r.cache_node for r in self.running], refs)
        else:
            self.pool.check_integrity(refs)
