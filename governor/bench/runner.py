"""The interleaved, randomised block runner.

Per level: every arm is warmed up with prompts of the workload's shape that the
measurement never uses (checked: all must succeed), then the measured blocks run one at a
time, never two arms at once, each after the machine has gone quiet (`quiet.wait_quiet`:
an engine's tail of busy CPU would otherwise land on the next arm). `interleaved` (the
default) runs round after round, each round one block of every arm in a freshly shuffled
order, so a slow change of the machine lands on every arm alike; `sequential` (all of A,
then all of B) exists to show what interleaving protects against and is never claimable
on its own.

Every request, warm-up included, is checked against `PromptHistory.bound`: cached tokens
the run cannot explain mean the prefix cache was not cold (observed, never assumed).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp

from governor.bench.client import RequestResult, complete_once, stream_completion
from governor.bench.config import Level
from governor.bench.probe import ArmIdentity, LogWatch
from governor.bench.quiet import NOT_CHECKED, Settle, wait_quiet
from governor.bench.workloads import PlannedBlock, PlannedRequest, WorkloadGenerator
from policies.ab_gate import PromptHistory

Progress = Callable[[int], None]
WARMUP_MAX_TOKENS = 16


@dataclass
class ArmHandle:
    """An arm during a run: its session, keys and what the run has sent it."""

    name: str
    url: str
    session: aiohttp.ClientSession
    keys: Sequence[str]
    identity: ArmIdentity
    history: PromptHistory
    log: LogWatch
    stated_compile_cache: str | None = None

    def headers(self, request: PlannedRequest) -> dict[str, str]:
        if not self.keys:
            return {}
        return {"Authorization": f"Bearer {self.keys[request.tenant or 0]}"}


@dataclass
class BlockRun:
    """One arm's block: `position` is its place in the level's schedule; `results` follow
    `planned.requests`; `duration` runs from the first dispatch to the last answer;
    `settle` is what the wait for a quiet machine before it found."""

    arm: str
    level: Level
    block: int
    position: int
    planned: PlannedBlock
    results: list[RequestResult]
    duration: float
    started_at: float
    cached_beyond_bound: int = 0
    unreported_cache: int = 0
    settle: Settle = NOT_CHECKED

    @property
    def ok(self) -> list[RequestResult]:
        return [r for r in self.results if r.success]

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.ok)

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.duration if self.duration > 0 else 0.0


@dataclass
class WarmupRun:
    arm: str
    succeeded: int
    failed: int
    cached_beyond_bound: int
    errors: list[str] = field(default_factory=list)


def schedule(arms: Sequence[str], blocks: int, rng: random.Random,
             order: str = "interleaved") -> list[tuple[str, int]]:
    """(arm, block index) in run order."""
    if order == "sequential":
        return [(arm, b) for arm in arms for b in range(blocks)]
    out: list[tuple[str, int]] = []
    for b in range(blocks):
        round_arms = list(arms)
        rng.shuffle(round_arms)
        out.extend((arm, b) for arm in round_arms)
    return out


def arrival_delays(n: int, rate: float | None, burstiness: float,
                   rng: random.Random) -> list[float]:
    """Start offsets in seconds: all at once for a burst; else gamma gaps with mean 1/rate
    and shape `burstiness` (1 = Poisson), as `vllm bench serve`."""
    if rate is None:
        return [0.0] * n
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


async def run_block(arm: ArmHandle, planned: PlannedBlock, level: Level, model: str,
                    delays: Sequence[float], progress: Progress) -> tuple[list[RequestResult],
                                                                          float, int, int]:
    """Run one block's sessions; returns results in `planned.requests` order, the block
    duration, the requests over the cache bound, and those that reported no cache figure."""
    slots = asyncio.Semaphore(level.concurrency or len(planned.sessions) or 1)
    send = stream_completion if level.stream else complete_once
    requests = planned.requests
    results: list[RequestResult | None] = [None] * len(requests)
    starts = []
    index = 0
    for session in planned.sessions:
        starts.append(index)
        index += len(session)
    beyond = unreported = 0
    t0 = time.perf_counter()

    async def one(i: int, request: PlannedRequest) -> None:
        nonlocal beyond, unreported
        queued = time.perf_counter()
        async with slots:
            arm.history.add(request.prompt_ids)
            result = await send(arm.session, arm.url, model, request, arm.headers(request))
        result.client_queue_time = result.start_time - queued
        if result.success:
            if result.cached_tokens is None:
                unreported += 1
            elif result.cached_tokens > arm.history.bound(request.prompt_ids):
                beyond += 1
        results[i] = result
        progress(1)

    async def run_session(s: int) -> None:
        await asyncio.sleep(max(0.0, t0 + delays[s] - time.perf_counter()))
        for k, request in enumerate(planned.sessions[s]):
            await one(starts[s] + k, request)

    await asyncio.gather(*(run_session(s) for s in range(len(planned.sessions))))
    duration = time.perf_counter() - t0
    return [r for r in results if r is not None], duration, beyond, unreported


async def warm_up(arm: ArmHandle, generator: WorkloadGenerator, level: Level, model: str,
                  count: int, progress: Progress) -> WarmupRun:
    """Discarded requests at the level's shape, with prompts no measured block uses."""
    planned = generator.block(level.label, "warmup", arm.name, count)
    short = PlannedBlock(tuple(tuple(_capped(r) for r in s) for s in planned.sessions))
    delays = [0.0] * len(short.sessions)
    results, _, beyond, _ = await run_block(arm, short, level, model, delays, progress)
    failed = [r for r in results if not r.success]
    return WarmupRun(arm.name, len(results) - len(failed), len(failed), beyond,
                     [r.error for r in failed[:3]])


def _capped(request: PlannedRequest) -> PlannedRequest:
    return PlannedRequest(request.prompt, request.prompt_ids,
                          min(request.output_len, WARMUP_MAX_TOKENS), request.tenant,
                          request.conversation, request.turn)


@dataclass
class LevelRun:
    level: Level
    warmups: dict[str, WarmupRun]
    blocks: list[BlockRun]
    compiled: dict[str, bool | None]

    def arm_blocks(self, arm: str) -> list[BlockRun]:
        return sorted((b for b in self.blocks if b.arm == arm), key=lambda b: b.block)

    def first_and_steady(self, arm: str) -> tuple[float | None, float | None]:
        """The first measured request's E2E latency and the median of the rest."""
        ok = sorted((r for b in self.arm_blocks(arm) for r in b.ok),
                    key=lambda r: r.start_time)
        if len(ok) < 2:
            return None, None
        return ok[0].latency or None, statistics.median(r.latency for r in ok[1:]) or None


async def run_level(arms: Sequence[ArmHandle], generator: WorkloadGenerator, level: Level,
                    model: str, requests: int, warmups: int, blocks: int, burstiness: float,
                    rng: random.Random, order: str, progress: Progress,
                    quiet: tuple[float, float]) -> LevelRun:
    """`quiet`: (the busy share of all CPUs a block may start at, the longest wait for it;
    0 s: no wait)."""
    warm = {}
    for arm in arms:
        warm[arm.name] = await warm_up(arm, generator, level, model, warmups, progress)
        arm.log.mark()
    by_name = {a.name: a for a in arms}
    runs = []
    for position, (name, b) in enumerate(schedule([a.name for a in arms], blocks, rng, order)):
        arm = by_name[name]
        planned = generator.block(level.label, b, name, requests)
        delays = arrival_delays(len(planned.sessions), level.request_rate, burstiness,
                                random.Random(f"{level.label}:{b}:arrivals"))
        settle = await wait_quiet(*quiet)
        started = time.time()
        results, duration, beyond, unreported = await run_block(arm, planned, level, model,
                                                                delays, progress)
        runs.append(BlockRun(name, level, b, position, planned, results, duration, started,
                             beyond, unreported, settle))
    compiled = {a.name: a.log.compiled_since_mark() for a in arms}
    return LevelRun(level, warm, runs, compiled)
