"""`fak bench ab`: two or more OpenAI-compatible endpoints on one workload, side by side.

Order of a run: identify every arm, write the plan (`plan.json`: config, run id, what each
arm reported about itself, host) and record its SHA-256 — before the first request; then
per level warm-up and interleaved blocks (`runner`), figures and verdicts (`analysis`,
`policies.ab_gate`), and the outputs: one validated A/B artifact per pair and level
(`artifacts/`), vLLM-format results per arm and block (`vllm/`), plots and `report.md`.

Exit status: 0 when every comparison is COMPARABLE, 1 when any was refused, 2 on a usage or
start-up error.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import random
import secrets
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from governor.bench import analysis, artifact, plots, report, vllm_results
from governor.bench.client import open_session
from governor.bench.config import ABConfig, ArmSpec, Level, WorkloadConfig, jsonable
from governor.bench.governor_proc import check_tenant_caps, running_governor
from governor.bench.probe import ArmIdentity, LogWatch, compile_facts, identify
from governor.bench.runner import ArmHandle, LevelRun, run_level
from governor.bench.workloads import WorkloadGenerator, load_tokenizer
from policies.ab_gate import ABDecision, ABGateConfig, PromptHistory
from policies.measurement import ArmWarmState, classify_arm
from schemas.bench import VERDICT_NOT_COMPARABLE


@dataclass
class Outcome:
    """What a run produced: the out directory's files and whether every claim held."""

    out: Path
    all_comparable: bool
    verdicts: list[str]
    artifacts: list[Path]
    plots: list[Path]
    report: Path


def api_keys(env: str) -> list[str]:
    raw = os.environ.get(env, "")
    return [k.strip() for k in raw.split(",") if k.strip()]


@contextlib.contextmanager
def arms_with_governor(config: ABConfig, keys: Sequence[str]
                       ) -> Iterator[tuple[list[ArmSpec], Any]]:
    """The configured arms, plus the governor arm when --through-governor asks for one."""
    if config.through_governor is None:
        yield list(config.arms), None
        return
    bursts = [lv.concurrency for lv in config.levels() if lv.concurrency is not None]
    if bursts:
        check_tenant_caps(config.through_governor, keys, max(bursts), queueing_counts=False)
    with running_governor(config.through_governor, config.out / "governor") as gov:
        yield [*config.arms, ArmSpec(config.governor_arm, gov.url, gov.log_path,
                                     config.governor_compile_cache)], gov


def _progress(total: int, enabled: bool) -> tuple[Callable[[int], None], Callable[[], None]]:
    if not enabled:
        return (lambda n: None), (lambda: None)
    from tqdm import tqdm  # type: ignore[import-untyped]

    bar = tqdm(total=total, unit="req", file=sys.stderr, dynamic_ncols=True, mininterval=0.5)
    return bar.update, bar.close


def _sequential_guard(decision: ABDecision, order: str) -> ABDecision:
    if order != "sequential":
        return decision
    return ABDecision(False, VERDICT_NOT_COMPARABLE,
                      (*decision.reasons, "arms ran sequentially, not interleaved: a drift of "
                       "the machine during the run would read as a difference"),
                      decision.warm_gate)


def _settle_guard(decision: ABDecision, run: LevelRun, arms: Sequence[str],
                  max_busy: float) -> ABDecision:
    """Refuse a pair when one of its blocks started on a machine that never went quiet."""
    loud = [b for b in run.blocks if b.arm in arms and b.settle.settled is False]
    if not loud:
        return decision
    worst = max(b.settle.busy or 0.0 for b in loud)
    return ABDecision(False, VERDICT_NOT_COMPARABLE,
                      (*decision.reasons, f"{len(loud)} block(s) started while the machine was "
                       f"still busy (up to {worst:.0%} of its CPUs, above {max_busy:.0%}, "
                       f"after {max(b.settle.waited_s for b in loud):.1f} s): another "
                       "process shared it"),
                      decision.warm_gate)


async def open_arms(specs: Sequence[ArmSpec], config: ABConfig, keys: list[str], gov: Any,
                     front_tokens: int) -> list[ArmHandle]:
    """Sessions and identities; a governor arm reports the engine its config forwards to
    and inherits that engine's compile facts when the engine is an arm too."""
    width = max(lv.concurrency or 64 for lv in config.levels())
    handles = []
    for spec in specs:
        session = open_session(width, config.request_timeout_s)
        ident = await identify(session, spec.url, {"Authorization": f"Bearer {keys[0]}"}
                               if keys else {})
        handles.append(ArmHandle(spec.name, spec.url, session, keys, ident,
                                 PromptHistory(front_tokens), LogWatch(spec.log),
                                 spec.compile_cache))
    if gov is not None:
        base = (gov.config.engine.base_url or "").rstrip("/")
        behind = next((h for h in handles if h.url == base), None)
        for h in handles:
            if h.url == gov.url:
                engine = behind.identity if behind else h.identity
                h.identity = ArmIdentity(f"fak governor → {engine.engine}", engine.version,
                                         h.identity.model, h.identity.owned_by, engine.eager)
                if behind and h.stated_compile_cache is None:
                    h.stated_compile_cache = behind.stated_compile_cache
    return handles


def write_plan(config: ABConfig, phases: Sequence[Phase], run_id: str,
               handles: Sequence[ArmHandle], model: str, tokenizer: str,
               host: dict[str, Any]) -> tuple[dict[str, Any], str]:
    arms = {}
    for h in handles:
        _, _, source = compile_facts(h.identity, h.stated_compile_cache, None)
        arms[h.name] = {"url": h.url, **h.identity.facts(), "compile_source": source,
                        "stated_compile_cache": h.stated_compile_cache}
    plan = {"run_id": run_id, "created_at": artifact.utc_now(), "tool": artifact.TOOL,
            "workload": config.workload.name, "model": model, "tokenizer": tokenizer,
            "levels": [{"label": p.level.label, "stream": p.level.stream,
                        "requests_per_block": p.requests, "warmup_requests": p.warmups,
                        "metric": p.metric or config.metric,
                        "workload": jsonable(p.workload)} for p in phases],
            "arms": arms, "host": host,
            "config": jsonable(config)}
    text = json.dumps(plan, indent=2, sort_keys=True) + "\n"
    config.out.mkdir(parents=True, exist_ok=True)
    (config.out / "plan.json").write_text(text)
    return plan, hashlib.sha256(text.encode()).hexdigest()


def _workload_facts(config: ABConfig, phase: Phase, run_id: str, sha: str, model: str
                    ) -> dict[str, Any]:
    w, level, requests = phase.workload, phase.level, phase.requests
    return {"name": w.name, "input_len": w.input_len, "output_len": w.output_len,
            "range_ratio": w.range_ratio, "prefix_len": w.prefix_len,
            "num_prefixes": w.num_prefixes, "turns": w.turns, "level": level.label,
            "max_concurrency": level.concurrency, "request_rate": level.request_rate,
            "burstiness": config.burstiness, "requests_per_block": requests,
            "blocks_per_arm": config.blocks, "order": config.order, "seed": config.seed,
            "run_id": run_id, "plan_sha256": sha, "model": model, "endpoint": "/v1/completions",
            "stream": level.stream, "ignore_eos": True, "temperature": 0}


def analyse_level(run: LevelRun, handles: Sequence[ArmHandle], config: ABConfig,
                  rng: random.Random, gate: ABGateConfig, metric: str
                  ) -> tuple[report.LevelReport, dict[str, Any], dict[str, Any]]:
    results = {h.name: analysis.arm_result(h.name, run.arm_blocks(h.name),
                                           run.warmups[h.name].cached_beyond_bound,
                                           config.goodput) for h in handles}
    states, sources = {}, {}
    for h in handles:
        states[h.name], sources[h.name] = analysis.warm_state(h, run, results[h.name])
    base = handles[0]
    pairs = []
    for other in handles[1:]:
        pair = analysis.compare_pair(run, base, other, states, results, metric, rng,
                                     config.bootstrap_resamples, gate, config.ratios)
        decision = _sequential_guard(pair.decision, config.order)
        decision = _settle_guard(decision, run, (base.name, other.name), config.settle_max_busy)
        pairs.append(replace(pair, decision=decision))
    classes = {n: classify_arm(ArmWarmState(n, s)).classification.value
               for n, s in states.items()}
    return (report.LevelReport(run.level.label, results, classes, pairs, metric,
                               report.settle_line(run.blocks, config.settle_max_busy)),
            states, sources)


async def run_ab(config: ABConfig) -> Outcome:
    keys = api_keys(config.api_key_env)
    run_id = config.run_id or secrets.token_hex(8)
    host = artifact.host_facts()
    tok = await asyncio.to_thread(load_tokenizer, config.tokenizer)
    with arms_with_governor(config, keys) as (specs, gov):
        handles = await open_arms(specs, config, keys, gov, tok.front_tokens)
        try:
            measured = await measure(config, ab_phases(config), handles, keys, run_id, host,
                                     tok)
        finally:
            for h in handles:
                await h.session.close()
    return finish(config, measured, f"fak bench ab — {config.workload.name}")


@dataclass(frozen=True, slots=True)
class Phase:
    """One measured load point with its own workload (ab: one per level; the overhead
    bench: latency, TTFT and throughput points)."""

    level: Level
    workload: WorkloadConfig
    requests: int
    warmups: int
    metric: str | None = None  # the compared figure; None: the config's


def ab_phases(config: ABConfig) -> list[Phase]:
    return [Phase(lv, config.workload, config.requests_for(lv), config.warmup_for(lv))
            for lv in config.levels()]


@dataclass
class Measured:
    """Every phase's runs and reports, with the plan they were registered under."""

    handles: list[ArmHandle]
    runs: list[LevelRun]
    reports: list[report.LevelReport]
    artifacts: list[Path]
    plan: dict[str, Any]
    sha: str
    model: str
    run_id: str
    tokenizer: str


async def measure(config: ABConfig, phases: Sequence[Phase], handles: list[ArmHandle],
                  keys: list[str], run_id: str, host: dict[str, Any], tok: Any) -> Measured:
    model = config.model or next((h.identity.model for h in handles if h.identity.model),
                                 None)
    if model is None:
        raise RuntimeError("no arm named its model on /v1/models; give --model")
    plan, sha = write_plan(config, phases, run_id, handles, model, tok.source, host)
    rng = random.Random(config.seed)
    gate = ABGateConfig(max_cv=config.max_cv)
    total = sum(len(handles) * (p.warmups + config.blocks * p.requests) for p in phases)
    update, close = _progress(total, config.progress)
    runs, level_reports, artifacts_out = [], [], []
    try:
        for phase in phases:
            generator = WorkloadGenerator(phase.workload, tok, config.seed, run_id,
                                          max(1, len(keys)))
            run = await run_level(handles, generator, phase.level, model, phase.requests,
                                  phase.warmups, config.blocks, config.burstiness, rng,
                                  config.order, update,
                                  (config.settle_max_busy, config.settle_timeout_s))
            runs.append(run)
            lrep, states, sources = analyse_level(run, handles, config, rng, gate,
                                                  phase.metric or config.metric)
            level_reports.append(lrep)
            artifacts_out += _write_artifacts(config, phase, lrep, states, sources, handles,
                                              host, run_id, sha, model)
    finally:
        close()
    return Measured(handles, runs, level_reports, artifacts_out, plan, sha, model, run_id,
                    tok.source)


def _arm_config(h: ArmHandle, source: str) -> dict[str, Any]:
    return {"url": h.url, **h.identity.facts(), "compile_source": source}


def _write_artifacts(config: ABConfig, phase: Phase, lrep: report.LevelReport,
                     states: dict[str, Any], sources: dict[str, str],
                     handles: Sequence[ArmHandle], host: dict[str, Any], run_id: str, sha: str,
                     model: str) -> list[Path]:
    arm_config = {h.name: _arm_config(h, sources[h.name]) for h in handles}
    level = phase.level
    workload = _workload_facts(config, phase, run_id, sha, model)
    out = []
    for pair in lrep.pairs:
        doc = artifact.build_artifact(pair, lrep.metric, lrep.arms, states, arm_config,
                                      {**host, "load_average_end": artifact.load_average()},
                                      workload)
        path = config.out / "artifacts" / f"ab-{level.label}-{pair.b}-vs-{pair.a}.json"
        artifact.write_artifact(doc, path)
        out.append(path)
    return out


def finish(config: ABConfig, m: Measured, title: str, extra: Sequence[str] = (),
           load_levels: Sequence[int] | None = None) -> Outcome:
    """vLLM-format results, plots and the report. `load_levels`: which phases the
    against-load plots draw (default all)."""
    handles, runs, level_reports, plan, sha = m.handles, m.runs, m.reports, m.plan, m.sha
    blocks = [b for run in runs for b in run.blocks]
    vllm_results.write_vllm_results(blocks, config.out, m.model, m.tokenizer,
                                    config.workload.name, m.run_id, config.goodput,
                                    config.burstiness)
    names = [h.name for h in handles]
    pngs = []
    for run, lrep in zip(runs, level_reports, strict=True):
        refused = any(not p.decision.claim_allowed for p in lrep.pairs)
        tag = " (NOT COMPARABLE)" if refused else ""
        ttfts = {n: [r.ttft for b in run.arm_blocks(n) for r in b.ok] for n in names}
        itl = {n: [x for b in run.arm_blocks(n) for r in b.ok for x in r.itl] for n in names}
        pngs.append(plots.ecdf_plot(config.out / f"ttft_ecdf-{lrep.label}.png",
                                    f"TTFT ECDF, {config.workload.name} {lrep.label}{tag}",
                                    "TTFT (ms)", ttfts))
        pngs.append(plots.ecdf_plot(config.out / f"itl_ecdf-{lrep.label}.png",
                                    f"ITL ECDF, {config.workload.name} {lrep.label}{tag}",
                                    "ITL (ms)", itl))
    def ttft(n: str, q: str) -> list[float | None]:
        return [getattr(s, q) if (s := lr.arms[n].ttft) else None for lr in level_reports]

    picked = list(load_levels) if load_levels is not None else list(range(len(runs)))
    pngs += plots.load_plots(
        config.out, [runs[i].level for i in picked], names,
        {n: [level_reports[i].arms[n].output_throughput for i in picked] for n in names},
        {n: [ttft(n, "p50")[i] for i in picked] for n in names},
        {n: [ttft(n, "p99")[i] for i in picked] for n in names}, title)
    text = report.render(title, plan, sha, level_reports, [p.name for p in pngs],
                         artifact.load_average(), extra)
    report_path = config.out / "report.md"
    report_path.write_text(text)
    verdicts = report.verdict_lines(level_reports)
    comparable = all(p.decision.claim_allowed for lr in level_reports for p in lr.pairs)
    return Outcome(config.out, comparable, verdicts, m.artifacts, pngs, report_path)
