"""`fak bench overhead --engine URL --config FILE`: the governor's own cost in front of an
engine (docs/reference/benchmarking.md §6 rule 8 and §7).

Both arms hit the same engine process from the same client: `direct` (client → engine) and
`governor` (client → `fak serve --config FILE` → engine), the governor started for the run.
Paired, interleaved, randomised rounds after a discarded warm-up (the `fak bench ab`
runner), at three kinds of load point:

- `latency`: non-streaming, 1 output token, one request at a time: added latency p50/p99;
- `ttft`: streaming, 1 output token, one at a time: added TTFT p50/p99;
- `throughput`: streaming, `max_tokens` tokens, at each concurrency: output-throughput
  ratio governor/direct;

and the governor process's CPU time (utime + stime from /proc) per request it served.
"Added" figures are governor − direct with the paired bootstrap interval; every load point
also gets the A/B artifact and the verdict, and a refused point's figures are labelled
diagnostic. To measure the governor alone, point `--engine` at a near-instant upstream
(`python bench/instant_upstream.py`), so the engine's own latency does not hide it.
"""

from __future__ import annotations

import asyncio
import random
import secrets
from collections.abc import Sequence

from governor.bench import artifact
from governor.bench.ab import (
    Measured,
    Outcome,
    Phase,
    api_keys,
    finish,
    measure,
    open_arms,
)
from governor.bench.config import ABConfig, ArmSpec, BenchConfigError, Level, WorkloadConfig
from governor.bench.governor_proc import check_tenant_caps, running_governor
from governor.bench.overhead_config import DIRECT, GOVERNOR, OverheadConfig
from governor.bench.runner import BlockRun
from governor.bench.workloads import load_tokenizer
from policies.ab_stats import RatioInterval, paired_bootstrap_difference, percentile


def overhead_ab_config(config: OverheadConfig) -> ABConfig:
    """The A/B settings the overhead run shares with `fak bench ab`."""
    return ABConfig(arms=(ArmSpec(DIRECT, config.engine, config.engine_log,
                                  config.engine_compile_cache),),
                    out=config.out, workload=_workload(config, 1),
                    concurrency=config.concurrency, blocks=config.rounds, seed=config.seed,
                    metric="e2el.p50", model=config.model, tokenizer=config.tokenizer,
                    api_key_env=config.api_key_env, through_governor=config.config,
                    governor_arm=GOVERNOR, max_cv=config.max_cv,
                    settle_max_busy=config.settle_max_busy,
                    settle_timeout_s=config.settle_timeout_s, progress=config.progress)


def _workload(config: OverheadConfig, output_len: int) -> WorkloadConfig:
    return WorkloadConfig(name="random", input_len=config.input_len, output_len=output_len)


def overhead_phases(config: OverheadConfig) -> list[Phase]:
    one = _workload(config, 1)
    out = [Phase(Level(1, None, "latency", stream=False), one, config.per_round,
                 config.warmup, "e2el.p50"),
           Phase(Level(1, None, "ttft"), one, config.per_round, config.warmup, "ttft.p50")]
    for c in config.concurrency:
        out.append(Phase(Level(c, None, "throughput"), _workload(config, config.max_tokens),
                         max(config.per_round, c), max(2, c), "output_throughput"))
    return out


def _added(a: Sequence[BlockRun], b: Sequence[BlockRun], pick: str, q: float,
           rng: random.Random) -> RatioInterval | None:
    def sample(block: BlockRun) -> list[float]:
        return [r.ttft if pick == "ttft" else r.latency for r in block.ok]

    return paired_bootstrap_difference([sample(x) for x in a], [sample(y) for y in b],
                                       lambda v: percentile(v, q), rng)


def _ms(iv: RatioInterval | None) -> str:
    if iv is None:
        return "–"
    return f"{iv.estimate * 1000:+.2f} ms (95% CI {iv.low * 1000:+.2f} – {iv.high * 1000:+.2f})"


def overhead_lines(m: Measured, cpu_ms_per_request: float | None, rng: random.Random
                   ) -> list[str]:
    lines = ["## Governor overhead", "",
             "| load point | verdict | figure | governor − direct or governor/direct |",
             "|---|---|---|---|"]
    for run, rep in zip(m.runs, m.reports, strict=True):
        pair = rep.pairs[0]
        verdict = pair.decision.verdict + ("" if pair.decision.claim_allowed
                                           else " (diagnostic only)")
        a, b = run.arm_blocks(DIRECT), run.arm_blocks(GOVERNOR)
        if run.level.tag in ("latency", "ttft"):
            pick = "latency" if run.level.tag == "latency" else "ttft"
            for q in (50.0, 99.0):
                name = "added latency" if pick == "latency" else "added TTFT"
                lines.append(f"| {rep.label} | {verdict} | {name} p{q:g} | "
                             f"{_ms(_added(a, b, pick, q, rng))} |")
        else:
            iv = pair.intervals.get("output_throughput")
            text = "–" if iv is None else (f"{iv.estimate:.3f} (95% CI {iv.low:.3f} – "
                                           f"{iv.high:.3f})")
            lines.append(f"| {rep.label} | {verdict} | output throughput ratio | {text} |")
    cpu = "not measured" if cpu_ms_per_request is None else f"{cpu_ms_per_request:.2f} ms"
    lines += ["", f"Governor CPU time per request (utime + stime over every request it "
              f"served, warm-ups included): {cpu}", ""]
    return lines


async def run_overhead(config: OverheadConfig) -> Outcome:
    ab = overhead_ab_config(config)
    keys = api_keys(ab.api_key_env)
    if not keys:
        raise BenchConfigError(f"set {ab.api_key_env} to an API key of a tenant in "
                               f"{config.config}: the governor arm needs one")
    check_tenant_caps(config.config, keys, max(config.concurrency), queueing_counts=True)
    tok = await asyncio.to_thread(load_tokenizer, config.tokenizer)
    host = artifact.host_facts()
    phases = overhead_phases(config)
    with running_governor(config.config, config.out / "governor") as gov:
        specs = [*ab.arms, ArmSpec(GOVERNOR, gov.url, gov.log_path)]
        handles = await open_arms(specs, ab, keys, gov, tok.front_tokens)
        try:
            cpu_start = gov.cpu_seconds()
            measured = await measure(ab, phases, handles, keys, secrets.token_hex(8), host,
                                     tok)
            cpu = gov.cpu_seconds() - cpu_start
        finally:
            for h in handles:
                await h.session.close()
    served = sum(len(b.results) for run in measured.runs for b in run.blocks
                 if b.arm == GOVERNOR)
    served += sum(w.succeeded + w.failed for run in measured.runs
                  for name, w in run.warmups.items() if name == GOVERNOR)
    lines = overhead_lines(measured, cpu * 1000 / served if served else None,
                           random.Random(config.seed))
    throughput = [i for i, p in enumerate(phases) if p.level.tag == "throughput"]
    return finish(ab, measured, "fak bench overhead", lines, throughput)

