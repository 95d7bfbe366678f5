"""The Markdown report: verdicts first, then figures. A refused comparison's ratios appear
only under a "diagnostic only" heading, never as a result."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from governor.bench.analysis import HIGHER_IS_BETTER, ArmResult, PairResult
from governor.bench.runner import BlockRun
from policies.ab_stats import Summary

DEFINITIONS = """\
Definitions (`vllm bench serve`, docs/reference/benchmarking.md §1): TTFT = first SSE message
with non-empty `choices` − request start; ITL = gaps between successive choices-bearing
messages (per chunk), pooled; E2EL = last choices-bearing message − start; TPOT =
(E2EL − TTFT) / (output tokens − 1); throughput = totals / summed block durations (each
block from first dispatch to last answer). Ratios are B/A; for throughput higher is better,
for latencies lower is better. Intervals: two-stage paired bootstrap over blocks (blocks
resampled in pairs, requests within them), 95% percentile interval."""


@dataclass(frozen=True, slots=True)
class LevelReport:
    label: str
    arms: dict[str, ArmResult]
    classes: dict[str, str]
    pairs: list[PairResult]
    metric: str
    settle: str = ""


def settle_line(blocks: Sequence[BlockRun], max_busy: float) -> str:
    """How the machine was before the level's blocks: the waits for quiet and their end."""
    checked = [b.settle for b in blocks if b.settle.settled is not None]
    if not checked:
        return "Blocks started without waiting for a quiet machine (wait off or no /proc/stat)."
    loud = sum(not s.settled for s in checked)
    waits = sorted(s.waited_s for s in checked)
    return (f"Before each block the runner waited for the machine to be at most "
            f"{max_busy:.0%} busy: {len(checked) - loud} of {len(checked)} blocks started so "
            f"(wait median {waits[len(waits) // 2]:.2f} s, longest {waits[-1]:.2f} s; busiest "
            f"start {max(s.busy or 0.0 for s in checked):.0%}).")


def _ms(s: Summary | None, attr: str) -> str:
    return "–" if s is None else f"{getattr(s, attr) * 1000:.1f}"


def _arm_table(level: LevelReport) -> list[str]:
    lines = ["| arm | class | ok / failed | out tok/s | req/s | TTFT p50 / p99 ms | "
             "ITL p50 / p99 ms | E2EL p50 / p99 ms | TPOT p50 ms | cache hit | tok/s CV |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in level.arms.items():
        hit = "–" if r.prefix_cache_hit_ratio is None else f"{r.prefix_cache_hit_ratio:.0%}"
        cv = "–" if r.output_throughput_cv is None else f"{r.output_throughput_cv:.1%}"
        lines.append(
            f"| {name} | {level.classes[name]} | {r.completed} / {r.failed} | "
            f"{r.output_throughput:.1f} | {r.request_throughput:.2f} | "
            f"{_ms(r.ttft, 'p50')} / {_ms(r.ttft, 'p99')} | {_ms(r.itl, 'p50')} / "
            f"{_ms(r.itl, 'p99')} | {_ms(r.e2el, 'p50')} / {_ms(r.e2el, 'p99')} | "
            f"{_ms(r.tpot, 'p50')} | {hit} | {cv} |")
    return lines


def _ratio_table(pair: PairResult) -> list[str]:
    lines = ["| metric | B/A | 95% interval | better |", "|---|---|---|---|"]
    for metric, iv in pair.intervals.items():
        if iv is None:
            lines.append(f"| {metric} | – | – | |")
            continue
        better = "higher" if metric in HIGHER_IS_BETTER else "lower"
        lines.append(f"| {metric} | {iv.estimate:.3f} | {iv.low:.3f} – {iv.high:.3f} | "
                     f"{better} |")
    return lines


def verdict_lines(levels: Sequence[LevelReport]) -> list[str]:
    lines = []
    for level in levels:
        metric = level.metric
        for pair in level.pairs:
            iv = pair.intervals.get(metric)
            d = pair.decision
            if d.claim_allowed and iv is not None:
                lines.append(f"{level.label} {pair.name}: COMPARABLE — {metric} ratio "
                             f"{iv.estimate:.3f} (95% CI {iv.low:.3f}–{iv.high:.3f})")
            else:
                lines.append(f"{level.label} {pair.name}: NOT COMPARABLE — "
                             + "; ".join(d.reasons or ("no interval",)))
    return lines


def render(title: str, plan: dict[str, Any], plan_sha256: str, levels: Sequence[LevelReport],
           plots: Sequence[str], load_end: str, extra: Sequence[str] = ()) -> str:
    """`extra`: Markdown lines placed after the verdicts (the overhead bench's figures)."""
    host = plan["host"]
    out = [f"# {title}", "", "## Verdicts", ""]
    out += [f"- {line}" for line in verdict_lines(levels)]
    out += ["", *extra] if extra else []
    out += ["", "## Plan (pre-registered)", "",
            f"- plan file `plan.json`, SHA-256 `{plan_sha256}`, run id `{plan['run_id']}`",
            f"- workload: `{plan['workload']}`; order {plan['config']['order']}, "
            f"{plan['config']['blocks']} blocks per arm per level, seed {plan['config']['seed']}",
            f"- host: {host.get('cpu_model')}, {host.get('cpus')} CPUs, flags "
            f"`{host.get('cpu_flags')}`; load average {host.get('load_average_start')}"
            f" at start, {load_end} at the end"]
    for name, arm in plan["arms"].items():
        out.append(f"- arm `{name}`: {arm['url']} — {arm['engine']}; compile facts from "
                   f"{arm['compile_source']}")
    for level in levels:
        out += ["", f"## Level {level.label}", "", *_arm_table(level)]
        out += ["", level.settle] if level.settle else []
        for pair in level.pairs:
            d = pair.decision
            out += ["", f"### {pair.name}: {d.verdict}", ""]
            out += [f"- {r}" for r in d.reasons]
            if d.claim_allowed:
                out += ["", "Result:", "", *_ratio_table(pair)]
            else:
                out += ["", "**Diagnostic only — not a result** (the comparison was refused):",
                        "", *_ratio_table(pair)]
    if plots:
        out += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    out += ["", "## Definitions", "", DEFINITIONS, ""]
    return "\n".join(out)
