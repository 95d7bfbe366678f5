"""From measured blocks to figures, warm states, paired ratios and the verdict.

Figures follow `vllm bench serve` (docs/reference/benchmarking.md §1), pooled over an arm's
blocks: latencies over every successful request (ITL over every chunk gap), throughput as
totals over the summed block durations. Ratios are B/A for each pair (A = the first arm),
with the two-stage paired bootstrap over blocks (`policies.ab_stats`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from governor.bench.client import RequestResult
from governor.bench.probe import compile_facts
from governor.bench.runner import ArmHandle, BlockRun, LevelRun
from policies.ab_gate import ABDecision, ABGateConfig, ArmRunFacts, decide
from policies.ab_stats import (
    RatioInterval,
    Summary,
    coefficient_of_variation,
    mean,
    paired_bootstrap_ratio,
    percentile,
    summarize,
)
from policies.measurement import ArmWarmState
from schemas.bench import PrefixCacheStart, WarmState

Statistic = Callable[[Sequence[float]], float]
HIGHER_IS_BETTER = ("output_throughput", "request_throughput")


def _p(q: float) -> Statistic:
    return lambda values: percentile(values, q)


# metric -> (per-block sample of a block, statistic over pooled samples)
METRIC_SAMPLES: dict[str, tuple[Callable[[BlockRun], list[float]], Statistic]] = {
    "output_throughput": (lambda b: [b.output_throughput], mean),
    "request_throughput": (lambda b: [len(b.ok) / b.duration] if b.duration else [], mean),
    "ttft.p50": (lambda b: [r.ttft for r in b.ok], _p(50)),
    "ttft.p99": (lambda b: [r.ttft for r in b.ok], _p(99)),
    "itl.p50": (lambda b: [x for r in b.ok for x in r.itl], _p(50)),
    "itl.p99": (lambda b: [x for r in b.ok for x in r.itl], _p(99)),
    "e2el.p50": (lambda b: [r.latency for r in b.ok], _p(50)),
    "e2el.p99": (lambda b: [r.latency for r in b.ok], _p(99)),
    "tpot.p50": (lambda b: [t for r in b.ok if (t := r.tpot) is not None], _p(50)),
}


@dataclass(frozen=True, slots=True)
class ArmResult:
    """One arm at one level, pooled over its blocks."""

    name: str
    blocks: int
    completed: int
    failed: int
    input_tokens: int
    output_tokens: int
    duration: float
    ttft: Summary | None
    tpot: Summary | None
    itl: Summary | None
    e2el: Summary | None
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    request_goodput: float | None
    output_throughput_cv: float | None
    prefix_cache_hit_ratio: float | None
    cached_beyond_bound: int
    errors: tuple[str, ...]


def _good(r: RequestResult, slos: Sequence[tuple[str, float]]) -> bool:
    values = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.latency}
    return all(ms / 1000.0 >= values[k] for k, ms in slos)


def arm_result(name: str, blocks: Sequence[BlockRun], warm_beyond: int,
               slos: Sequence[tuple[str, float]]) -> ArmResult:
    ok = [r for b in blocks for r in b.ok]
    failed = [r for b in blocks for r in b.results if not r.success]
    duration = sum(b.duration for b in blocks)
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    cached = [r.cached_tokens for r in ok]
    hit = (sum(c for c in cached if c is not None) / in_tokens
           if ok and in_tokens and None not in cached else None)
    rate = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    return ArmResult(
        name=name, blocks=len(blocks), completed=len(ok), failed=len(failed),
        input_tokens=in_tokens, output_tokens=out_tokens, duration=duration,
        ttft=summarize([r.ttft for r in ok]),
        tpot=summarize([t for r in ok if (t := r.tpot) is not None]),
        itl=summarize([x for r in ok for x in r.itl]),
        e2el=summarize([r.latency for r in ok]),
        request_throughput=rate(len(ok)), output_throughput=rate(out_tokens),
        total_token_throughput=rate(in_tokens + out_tokens),
        request_goodput=rate(sum(_good(r, slos) for r in ok)) if slos else None,
        output_throughput_cv=coefficient_of_variation([b.output_throughput for b in blocks]),
        prefix_cache_hit_ratio=min(1.0, hit) if hit is not None else None,
        cached_beyond_bound=warm_beyond + sum(b.cached_beyond_bound for b in blocks),
        errors=tuple(r.error for r in failed[:10]),
    )


def warm_state(arm: ArmHandle, run: LevelRun, result: ArmResult) -> tuple[WarmState, str]:
    """The arm's observed warm state at this level, and where its compile facts came from."""
    warmup = run.warmups[arm.name]
    compile_cache, rtc, source = compile_facts(arm.identity, arm.stated_compile_cache,
                                               run.compiled.get(arm.name))
    unreported = sum(b.unreported_cache for b in run.arm_blocks(arm.name))
    if result.cached_beyond_bound:
        prefix: PrefixCacheStart | None = PrefixCacheStart.CONTAMINATED
    elif unreported:
        prefix = None
    else:
        prefix = PrefixCacheStart.WARM_DISJOINT
    first, steady = run.first_and_steady(arm.name)
    state = WarmState(warmup_done=warmup.failed == 0 and warmup.succeeded > 0,
                      compile_cache=compile_cache, request_time_compilation=rtc,
                      prefix_cache_at_start=prefix, first_request_latency_s=first,
                      steady_state_latency_s=steady)
    return state, source


def block_ratios(a: Sequence[BlockRun], b: Sequence[BlockRun], metric: str) -> list[float]:
    """Per block index, B/A of the metric, in block order (the drift series)."""
    sample, stat = METRIC_SAMPLES[metric]
    out = []
    for x, y in zip(a, b, strict=True):
        sx, sy = sample(x), sample(y)
        if sx and sy and stat(sx) > 0:
            out.append(stat(sy) / stat(sx))
    return out


def pair_interval(a: Sequence[BlockRun], b: Sequence[BlockRun], metric: str,
                  rng: random.Random, resamples: int) -> RatioInterval | None:
    sample, stat = METRIC_SAMPLES[metric]
    return paired_bootstrap_ratio([sample(x) for x in a], [sample(y) for y in b], stat, rng,
                                  resamples)


@dataclass(frozen=True, slots=True)
class PairResult:
    """B against A at one level: every metric's interval, the verdict on the pair."""

    a: str
    b: str
    intervals: dict[str, RatioInterval | None]
    drift: list[float]
    decision: ABDecision

    @property
    def name(self) -> str:
        return f"{self.b}/{self.a}"


def compare_pair(run: LevelRun, a: ArmHandle, b: ArmHandle,
                 states: dict[str, WarmState], results: dict[str, ArmResult], metric: str,
                 rng: random.Random, resamples: int, gate: ABGateConfig,
                 ratios: Sequence[str] = tuple(METRIC_SAMPLES)) -> PairResult:
    """`ratios`: the figures to bootstrap (the compared `metric` always is)."""
    blocks_a, blocks_b = run.arm_blocks(a.name), run.arm_blocks(b.name)
    wanted = [m for m in METRIC_SAMPLES if m in ratios or m == metric]
    intervals = {m: pair_interval(blocks_a, blocks_b, m, rng, resamples) for m in wanted}
    drift = block_ratios(blocks_a, blocks_b, metric)
    facts = [ArmRunFacts(n, results[n].completed, results[n].failed,
                         results[n].output_tokens, results[n].cached_beyond_bound,
                         results[n].output_throughput_cv, next(iter(results[n].errors), ""))
             for n in (a.name, b.name)]
    warm = [ArmWarmState(n, states[n]) for n in (a.name, b.name)]
    decision = decide(warm, facts, {f"{b.name}/{a.name}": drift}, gate)
    return PairResult(a.name, b.name, intervals, drift, decision)
