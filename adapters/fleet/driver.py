"""`FleetDriver`: several vLLM-compatible upstreams (each with data-parallel ranks) behind the
one EngineDriver protocol, so the governor does not change shape (docs/design.md §7).

- Routing: per request the members (upstream, rank) that are up are ordered by
  policies.routing — for `kv_aware` from each rank's shadow index, matched in the request's
  own namespace (its salt's chain), and the rank's load. The request goes to the first.
- Failover before the first byte: a refused connection or a 5xx before any chunk was
  yielded is retried once on the next-best member (another upstream when the connection was
  lost, which also marks the upstream down). After the first chunk a failure is raised as
  is: the governor turns it into one SSE error event.
- Health: one watcher per upstream (adapters/fleet/health.py); an upstream gets traffic only
  while up, and it is up only after a probe passed since it was last seen down or restarted.
- Cache control is per member (`cache_members()`): a quarantine runs on each.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import statistics
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from adapters.driver import CacheMember
from adapters.prompt_tokens import ChainKey, PromptDraft, PromptIds, PromptTokens
from adapters.vllm.cache_control import VLLMCacheControl
from adapters.vllm.capabilities import CapabilityRefusedError, UpstreamUnreachable
from adapters.vllm.kv_subscriber import SyncState
from adapters.vllm.shadow_index import ShadowIndex
from policies.routing import (
    Candidate,
    RoutingPolicy,
    RoutingWeights,
    beats_whatever_follows,
    predicted_cached_tokens,
    rank_order,
)
from schemas.cache_control import (
    CacheControlUnsupported,
    KVMark,
    KVRemoval,
    ResetResult,
    SpanEviction,
    SpanSpec,
)
from schemas.engine import EngineCapabilities, EngineError, EngineRequest, StreamChunk, Usage
from schemas.openai import Route

from .capabilities import fleet_capabilities
from .health import HealthConfig, HealthWatch
from .state import Member, Upstream, connection_lost, retryable

DECISION_WINDOW = 4096
NAMESPACE_MEMO = 4096  # (index keying, salt) -> namespace digest


@dataclass(frozen=True, slots=True)
class FleetConfig:
    policy: RoutingPolicy = RoutingPolicy.KV_AWARE
    weights: RoutingWeights = field(default_factory=RoutingWeights)
    health: HealthConfig = field(default_factory=HealthConfig)


@dataclass(slots=True)
class Decision:
    """Members best first, and the cached tokens each would be predicted to report (by
    member name; none without the prompt's tokens). An early decision (`pending` set) was
    taken on the prompt's known leading ids alone, which fixed the first member whatever
    the rest of the prompt; `settle()` tokenises the rest, then orders the others and fills
    in the predictions and the prompt's length."""

    order: tuple[Member, ...]
    predicted: dict[str, int]
    prompt_tokens: int | None
    pending: Callable[[], None] | None = None

    def settle(self) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            pending()


class FleetCacheControl:
    """A fleet is controlled member by member (`FleetDriver.cache_members`)."""

    async def evict_span(self, namespace: str, span: SpanSpec, start: int) -> SpanEviction:
        raise CacheControlUnsupported("exact-span eviction is not offered across a fleet")

    async def reset_prefix_cache(self) -> ResetResult:
        raise CacheControlUnsupported("a fleet resets member by member")

    async def kv_mark(self, settle_s: float) -> KVMark | None:
        return None

    async def kv_removal(self, mark: KVMark, done: Any, timeout_s: float) -> KVRemoval:
        raise CacheControlUnsupported("a fleet's KV evidence is per member")

    async def probe(self, tenant: str, salt: str, route: Route, body: dict[str, Any],
                    timeout_s: float) -> Usage | None:
        raise CacheControlUnsupported("a fleet probes member by member")


class FleetDriver:
    def __init__(self, upstreams: Sequence[Upstream], config: FleetConfig | None = None,
                 tokens: PromptTokens | None = None) -> None:
        if not upstreams:
            raise ValueError("a fleet needs at least one upstream")
        self.upstreams = tuple(upstreams)
        self.config = config or FleetConfig()
        self.tokens = tokens or PromptTokens()
        self.members = tuple(m for u in self.upstreams for m in u.members)
        self.capabilities = EngineCapabilities(engine_kind="vllm", model_id="",
                                               notes=("not probed",))
        self.cache_control = FleetCacheControl()
        self.decision_seconds: deque[float] = deque(maxlen=DECISION_WINDOW)
        self.tokenize_seconds: deque[float] = deque(maxlen=DECISION_WINDOW)
        # The same decisions in this thread's CPU time: wall time less what the OS gave to
        # other processes meanwhile (engines sharing the cores preempt the governor).
        self.decision_cpu_seconds: deque[float] = deque(maxlen=DECISION_WINDOW)
        # Early decisions' settling (tokenising the rest once the request is on its way).
        self.settle_seconds: deque[float] = deque(maxlen=DECISION_WINDOW)
        self.early_decisions = 0
        self._namespaces: dict[tuple[bytes, str], str | None] = {}
        self._turn = 0
        self._health: HealthWatch | None = None

    # --- life -------------------------------------------------------------------------

    async def start(self) -> None:
        """Probe every upstream; one whose isolation fails refuses start-up, one that cannot
        be reached is down (probed again before it gets traffic); none up refuses too."""
        now = time.monotonic()
        probed = {}
        for upstream, outcome in zip(self.upstreams, await asyncio.gather(
                *(u.driver.start() for u in self.upstreams), return_exceptions=True),
                strict=True):
            if isinstance(outcome, UpstreamUnreachable):
                upstream.mark_down(now, str(outcome))
            elif isinstance(outcome, BaseException):
                await self.close()
                if isinstance(outcome, CapabilityRefusedError):
                    raise CapabilityRefusedError(f"upstream {upstream.name}: {outcome}")
                raise outcome
            else:
                upstream.mark_up(now)
                probed[upstream.name] = upstream.driver.capabilities
        if not probed:
            await self.close()
            reasons = "; ".join(f"{u.name}: {u.refusal}" for u in self.upstreams)
            raise CapabilityRefusedError(f"no upstream could be probed ({reasons})")
        self.capabilities = fleet_capabilities(probed)
        self._health = HealthWatch(self.upstreams, self.capabilities, self.config.health)
        self._health.start()

    async def close(self) -> None:
        if self._health is not None:
            await self._health.stop()
            self._health = None
        for upstream in self.upstreams:
            await upstream.driver.close()

    async def ready(self) -> bool:
        return any(u.up for u in self.upstreams)

    async def alive(self) -> bool:
        return True  # remote engines being down is readiness, not this process's life

    async def models(self) -> dict[str, Any]:
        for upstream in self.upstreams:
            if upstream.up:
                return await upstream.driver.models()
        raise EngineError(503, "no upstream is up", type="ServiceUnavailable")

    async def serving_metrics(self) -> dict[str, float | None]:
        """Counters and gauges summed over the upstreams that answered; latency quantiles
        do not add up, so they are None here (per-upstream values are on each engine)."""
        windows = [w for w in await asyncio.gather(
            *(u.driver.serving_metrics() for u in self.upstreams if u.up),
            return_exceptions=True) if isinstance(w, dict)]
        if not windows:
            raise EngineError(502, "no upstream answered its metrics scrape",
                              type="UpstreamUnavailableError")
        total: dict[str, float | None] = {}
        for key in windows[0]:
            values = [w[key] for w in windows if w.get(key) is not None]
            summable = not key.endswith(("_p50", "_p90", "_p99", "_ratio"))
            total[key] = sum(values) if values and summable else None  # type: ignore[arg-type]
        if total.get("kv_usage") is not None:
            total["kv_usage"] = total["kv_usage"] / len(windows)  # type: ignore[operator]
        queries, hits = total.get("prefix_cache_queries"), total.get("prefix_cache_hits")
        total["prefix_cache_hit_ratio"] = hits / queries if queries and hits is not None \
            else None
        return total

    # --- routing ----------------------------------------------------------------------

    def route(self, request: EngineRequest) -> Decision:
        """Order the members that are up for this request, settled (`decide`)."""
        decision = self.decide(request)
        decision.settle()
        return decision

    def decide(self, request: EngineRequest) -> Decision:
        """Order the members that are up for this request (policies.routing): early, on
        the ids the token-prefix cache knows, where they fix the first member (`_early`);
        else on all the prompt's ids."""
        cpu_started = time.thread_time()  # a system call: outside the wall-clock span
        started = time.perf_counter()
        kv_aware = self.config.policy is RoutingPolicy.KV_AWARE
        draft = self.tokens.draft(request) if kv_aware else None
        # Knowing no id, a rank's overlap could be the whole prompt's wherever it holds
        # anything of the namespace: then not worth trying.
        early = None if draft is None or (not draft.known and self._any_may_hold(
            request.cache_salt)) else self._early(draft)
        if early is not None:
            self._timed(started, cpu_started)
            self.tokenize_seconds.append(0.0)  # nothing tokenised before it
            return early
        if draft is not None:
            tokens = self.tokens.finish(draft)
        else:
            tokens = self.tokens.of(request) if kv_aware else None
        self.tokenize_seconds.append(time.perf_counter() - started)
        return self._rank(request, tokens, started, cpu_started)

    async def route_off_loop(self, request: EngineRequest) -> Decision:
        """`route`, a long prompt tokenised on a worker thread (`PromptTokens.of_off_loop`):
        the same ids, while the loop goes on relaying. The decision's CPU time is then the
        loop's part only."""
        if not self._long(request):
            return self.route(request)
        started = time.perf_counter()
        tokens = await self.tokens.of_off_loop(request, self._chain_keys(request.cache_salt))
        self.tokenize_seconds.append(time.perf_counter() - started)
        return self._rank(request, tokens, started, time.thread_time())

    def _long(self, request: EngineRequest) -> bool:
        return self.config.policy is RoutingPolicy.KV_AWARE and self.tokens.is_long(request)

    def _chain_keys(self, salt: str | None) -> set[ChainKey]:
        """The (namespace digest, block size) of every member `_rank` will match in."""
        return {key for member in self.members if member.upstream.up
                and (key := self._chain_key(member, salt)) is not None}

    def _chain_key(self, member: Member, salt: str | None) -> ChainKey | None:
        """Where `member` matches a prompt: its index's namespace digest for `salt` and its
        block size; None without KV events."""
        kv = member.upstream.driver.kv
        if kv is None:
            return None
        return self._namespace(kv.index(member.rank), salt), \
            member.upstream.driver.capabilities.block_size or 1

    def _namespace(self, index: ShadowIndex, salt: str | None) -> str | None:
        """`index.namespace_id(salt)`, remembered per index keying: an HMAC a decision
        otherwise (the governor holds the tenants' salts anyway; this is never shown)."""
        if salt is None:
            return None
        key = (index.keying, salt)
        digest = self._namespaces.get(key)
        if digest is None:
            if len(self._namespaces) >= NAMESPACE_MEMO:
                self._namespaces.clear()
            digest = self._namespaces[key] = index.namespace_id(salt)
        return digest

    def _rank(self, request: EngineRequest, tokens: PromptIds | None, started: float,
              cpu_started: float) -> Decision:
        candidates = self._candidates(request, tokens)
        decision = Decision((), {}, None)
        self._settled(decision, tokens, candidates, self._turn)
        self._turn += 1
        self._timed(started, cpu_started)
        return decision

    def _candidates(self, request: EngineRequest, tokens: PromptIds | PromptDraft | None
                    ) -> list[Candidate]:
        """The members that are up, with their overlap (a draft's: of its known ids, and
        whether it could match more of the prompt). Each member's chain key is derived once
        here: a decision between requests runs with the caches cold, where every lookup
        costs."""
        candidates, salt = [], request.cache_salt
        drafted = isinstance(tokens, PromptDraft)
        for index, member in enumerate(self.members):
            if member.upstream.up:
                key = self._chain_key(member, salt)
                overlap, synced = self._overlap(member, key, tokens)
                candidates.append(Candidate(
                    index, member.upstream.driver.capabilities.block_size or 1, overlap,
                    synced, member.in_flight, member.engine_load,
                    not drafted or self._may_hold(member, key)))
        return candidates

    @staticmethod
    def _may_hold(member: Member, key: ChainKey | None) -> bool:
        """Whether `member`'s index could match anything in the namespace of `key`."""
        kv = member.upstream.driver.kv
        return key is not None and kv is not None and kv.index(member.rank).may_hold(key[0])

    def _any_may_hold(self, salt: str | None) -> bool:
        return any(self._may_hold(m, self._chain_key(m, salt)) for m in self.members
                   if m.upstream.up)

    def _settled(self, decision: Decision, tokens: PromptIds | None,
                 candidates: list[Candidate], turn: int) -> None:
        """Fill in `decision` from the prompt's ids: the order (after its first member, if
        it has one already) and each member's predicted cached tokens."""
        prompt_tokens = None if tokens is None else len(tokens.ids)
        order = [self.members[i] for i in rank_order(
            self.config.policy, candidates, prompt_tokens or 0, self.config.weights, turn,
            len(self.members))]
        if decision.order:
            order.remove(decision.order[0])
            order.insert(0, decision.order[0])
        decision.order, decision.prompt_tokens = tuple(order), prompt_tokens
        if tokens is not None:
            decision.predicted = {self.members[c.member].name: predicted_cached_tokens(
                len(tokens.ids), c.credited_blocks, c.block_size) for c in candidates}

    def _early(self, draft: PromptDraft) -> Decision | None:
        """A decision on the draft's known ids where they fix the first member: a member's
        overlap is exact where its index misses one of the known blocks, and at most the
        whole prompt's blocks where it holds them all; the first member must beat every
        other at their most (policies.routing.beats_whatever_follows). None otherwise.
        The rest is settled later (`Decision.settle`) with the loads and turn of now."""
        candidates = self._candidates(draft.request, draft)
        known, most = draft.known, draft.known + draft.more_at_most
        if not candidates or len({c.block_size for c in candidates}) != 1:
            return None
        turn = self._turn
        first = rank_order(self.config.policy, candidates, known + 1, self.config.weights,
                           turn, len(self.members))[0]
        best = next(c for c in candidates if c.member == first)
        if not beats_whatever_follows(best, candidates, known, most, self.config.weights):
            return None
        self._turn += 1
        self.early_decisions += 1
        decision = Decision((self.members[first],), {}, None)
        decision.pending = functools.partial(self._settle, decision, draft, candidates, turn)
        return decision

    def _settle(self, decision: Decision, draft: PromptDraft, candidates: list[Candidate],
                turn: int) -> None:
        started = time.perf_counter()
        tokens = self.tokens.finish(draft)
        salt, exact = draft.request.cache_salt, []
        for c in candidates:
            member = self.members[c.member]
            overlap = self._overlap(member, self._chain_key(member, salt), tokens)[0]
            exact.append(dataclasses.replace(c, overlap_blocks=overlap))
        self._settled(decision, tokens, exact, turn)
        self.settle_seconds.append(time.perf_counter() - started)

    def _timed(self, started: float, cpu_started: float) -> None:
        self.decision_seconds.append(time.perf_counter() - started)
        self.decision_cpu_seconds.append(time.thread_time() - cpu_started)

    @staticmethod
    def _overlap(member: Member, key: ChainKey | None, tokens: PromptIds | PromptDraft | None
                 ) -> tuple[int, bool]:
        """`member`'s leading blocks of the prompt in its index, in the namespace of `key`
        (its `_chain_key`), and whether that index is SYNCED."""
        if tokens is None or (isinstance(tokens, PromptIds) and not tokens.ids):
            return 0, False  # (a draft's known ids may be none: its chain is empty)
        kv = member.upstream.driver.kv
        if key is None or kv is None:
            return 0, False
        chain = tokens.chain(*key)  # once per request and key
        return kv.index(member.rank).matched_blocks(chain), \
            kv.state(member.rank) is SyncState.SYNCED

    def routing_view(self) -> dict[str, Any]:
        """The policy, the median cost of the last routing decisions (whole, in wall and in
        CPU time, and the part spent tokenising the prompt) and the token-prefix cache's
        counters (None: off)."""
        window, tokenize = list(self.decision_seconds), list(self.tokenize_seconds)
        cpu, settle = list(self.decision_cpu_seconds), list(self.settle_seconds)
        cache = self.tokens.cache
        return {"policy": self.config.policy.value, "decisions": len(window),
                "decision_p50_ms": statistics.median(window) * 1000 if window else None,
                "decision_cpu_p50_ms": statistics.median(cpu) * 1000 if cpu else None,
                "tokenize_p50_ms": statistics.median(tokenize) * 1000 if tokenize else None,
                "early_decisions": self.early_decisions,
                "settle_p50_ms": statistics.median(settle) * 1000 if settle else None,
                "tokenize_cache": None if cache is None else
                {"texts": len(cache), **asdict(cache.stats)}}

    # --- generation -------------------------------------------------------------------

    async def generate(self, request: EngineRequest) -> AsyncGenerator[StreamChunk, None]:
        decision = await self.route_off_loop(request) if self._long(request) \
            else self.decide(request)
        if not decision.order:
            raise EngineError(503, "no upstream is up", type="ServiceUnavailable")
        member = decision.order[0]
        if decision.pending is not None:  # settled once the request is on its way: the
            asyncio.get_running_loop().call_soon(decision.settle)  # loop's next turn
        tried: list[Member] = []
        answered = 0  # 5xx answers among the failures
        while True:
            try:
                chunks, first = await self._open(member, request)
                break
            except EngineError as exc:
                tried.append(member)
                answered += not connection_lost(exc)
                fallback = self._fallback(decision, tried, exc, answered)
                member.note_failure(exc, fallback)
                if fallback is None:
                    raise
                member.failovers += 1
                member = fallback
        usage = first.usage
        try:
            yield first
            async for chunk in chunks:
                usage = chunk.usage or usage
                yield chunk
        finally:
            member.in_flight -= 1
            await chunks.aclose()
            decision.settle()
            if member.name in decision.predicted:
                member.record_prediction(decision.predicted[member.name],
                                         None if usage is None else usage.cached_tokens)

    async def _open(self, member: Member, request: EngineRequest
                    ) -> tuple[AsyncGenerator[StreamChunk, None], StreamChunk]:
        """Start the request on `member` and wait for its first chunk."""
        member.in_flight += 1
        member.decisions += 1
        member.last_routed_at = time.monotonic()
        chunks = member.upstream.driver.generate(request, dp_rank=member.rank_header)
        assert isinstance(chunks, AsyncGenerator)
        try:
            first = await anext(chunks)
        except BaseException as exc:
            member.in_flight -= 1
            with contextlib.suppress(Exception):
                await chunks.aclose()
            if isinstance(exc, EngineError) and connection_lost(exc):
                member.upstream.mark_down(time.monotonic(), exc.message)
            if isinstance(exc, StopAsyncIteration):
                raise EngineError(502, "the upstream answered nothing",
                                  type="UpstreamUnavailableError") from None
            raise
        return chunks, first

    @staticmethod
    def _fallback(decision: Decision, tried: Sequence[Member], exc: EngineError,
                  answered: int) -> Member | None:
        """The next-best member not yet tried whose upstream is up (one whose connection
        was lost is down by now, with all its ranks). A failure of the connection (refused,
        connect timed out, held back for a re-probe, broken) costs no engine anything —
        it never reached one, or the one that had it is gone — so the request goes on to
        each upstream that is up, once; `answered` 5xx answers get one retry between them."""
        decision.settle()
        if not retryable(exc) or answered > 1:
            return None
        return next((m for m in decision.order if m not in tried and m.upstream.up), None)

    # --- views ------------------------------------------------------------------------

    def cache_members(self) -> tuple[CacheMember, ...]:
        return tuple(
            CacheMember(m.name, m.upstream.up, m.upstream.driver.capabilities,
                        VLLMCacheControl(m.upstream.driver, m.rank_header))
            for m in self.members)

    def upstream_views(self) -> list[dict[str, Any]]:
        return [u.view() for u in self.upstreams]

    def upstream(self, name: str) -> Upstream:
        return next(u for u in self.upstreams if u.name == name)

    def check_integrity(self) -> None:
        for upstream in self.upstreams:
            upstream.check_integrity()
