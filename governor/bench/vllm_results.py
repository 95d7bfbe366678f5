"""One result JSON per arm and block, as `vllm bench serve --save-result --save-detailed`
writes it (vllm/benchmarks/serve.py, 0.32), laid out as `vllm bench sweep serve` lays out
its runs, so vLLM's own tooling reads them: `<out>/vllm/<arm>-<level>/run=<block>.json` and
that directory's `summary.json` (the list of its runs, which `vllm bench sweep plot` reads).

Field names and units are vLLM's: milliseconds for `mean_/median_/std_/pNN_*_ms`, seconds in
the detailed lists; `request_goodput` is null without SLOs. Keys vLLM would take from
`--metadata` carry fak's own facts (arm, block, position, workload, run id).
"""

from __future__ import annotations

import datetime as dt
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from governor.bench.client import RequestResult
from governor.bench.config import Level
from governor.bench.runner import BlockRun
from policies.ab_stats import percentile

PERCENTILES = (50.0, 90.0, 99.0)


def _stats(name: str, values: Sequence[float]) -> dict[str, float]:
    """vLLM's per-metric keys, in ms; vLLM reports 0 for an empty sample (`values or 0`)."""
    data = list(values) or [0.0]
    m = math.fsum(data) / len(data)
    out = {f"mean_{name}_ms": m * 1000,
           f"median_{name}_ms": percentile(data, 50) * 1000,
           f"std_{name}_ms": math.sqrt(math.fsum((v - m) ** 2 for v in data) / len(data)) * 1000}
    for p in PERCENTILES:
        word = str(int(p)) if int(p) == p else str(p)
        out[f"p{word}_{name}_ms"] = percentile(data, p) * 1000
    return out


def peak_rates(results: Sequence[RequestResult]) -> tuple[float, int]:
    """vLLM's `max_output_tokens_per_s` (chunks per one-second bin) and
    `max_concurrent_requests` (requests active per bin)."""
    ok = [r for r in results if r.success]
    if not ok:
        return 0.0, 0
    t0 = min(r.start_time for r in ok)
    end = max(r.start_time + r.latency for r in ok)
    bins = math.ceil(end - t0) + 1
    tokens, active = [0] * bins, [0] * bins
    for r in ok:
        t = r.start_time + r.ttft
        times = [t]
        for gap in r.itl:
            t += gap
            times.append(t)
        for x in times:
            if 0 <= int(x - t0) < bins:
                tokens[int(x - t0)] += 1
        for s in range(int(r.start_time - t0), int(r.start_time + r.latency - t0) + 1):
            active[s] += 1
    return float(max(tokens)), max(active)


def _good(r: RequestResult, slos: Sequence[tuple[str, float]]) -> bool:
    values = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.latency}
    return all(ms / 1000.0 >= values[k] for k, ms in slos)


def result_json(block: BlockRun, model: str, tokenizer_id: str, workload: str, run_id: str,
                slos: Sequence[tuple[str, float]], burstiness: float = 1.0) -> dict[str, Any]:
    results, dur = block.results, block.duration
    ok = [r for r in results if r.success]
    out_lens = [r.output_tokens if r.success else 0 for r in results]
    total_in = sum(r.prompt_len for r in ok)
    peak_tokens, peak_active = peak_rates(results)
    level: Level = block.level
    doc: dict[str, Any] = {
        "date": dt.datetime.fromtimestamp(block.started_at).strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": "openai", "backend": "openai", "label": block.arm,
        "model_id": model, "tokenizer_id": tokenizer_id, "num_prompts": len(results),
        "arm": block.arm, "block": block.block, "position": block.position,
        "workload": workload, "fak_run_id": run_id,
        "request_rate": level.request_rate if level.request_rate is not None else "inf",
        "burstiness": burstiness, "max_concurrency": level.concurrency,
        "duration": dur, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": sum(out_lens),
        "request_throughput": len(ok) / dur if dur else 0.0,
        "request_goodput": (sum(_good(r, slos) for r in ok) / dur if dur else 0.0)
        if slos else None,
        "output_throughput": sum(out_lens) / dur if dur else 0.0,
        "total_token_throughput": (total_in + sum(out_lens)) / dur if dur else 0.0,
        "input_lens": [r.prompt_len for r in results], "output_lens": out_lens,
        "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
        "latencies": [r.latency for r in results],
        "start_times": [r.start_time for r in results],
        "queue_times": [r.client_queue_time for r in results],
        "generated_texts": [r.generated_text for r in results],
        "errors": [r.error for r in results],
        "max_output_tokens_per_s": peak_tokens, "max_concurrent_requests": peak_active,
        "rtfx": 0.0,
    }
    doc.update(_stats("ttft", [r.ttft for r in ok]))
    doc.update(_stats("tpot", [t for r in ok if (t := r.tpot) is not None]))
    doc.update(_stats("itl", [x for r in ok for x in r.itl]))
    doc.update(_stats("e2el", [r.latency for r in ok]))
    if level.concurrency is not None:
        doc.update(_stats("client_queue_time", [r.client_queue_time for r in ok]))
    return doc


def write_vllm_results(blocks: Sequence[BlockRun], out: Path, model: str, tokenizer_id: str,
                       workload: str, run_id: str, slos: Sequence[tuple[str, float]],
                       burstiness: float = 1.0) -> list[Path]:
    """Every block's run file and each arm-and-level directory's summary.json."""
    written = []
    groups: dict[Path, list[dict[str, Any]]] = {}
    for block in sorted(blocks, key=lambda b: (b.arm, b.level.label, b.block)):
        directory = out / "vllm" / f"{block.arm}-{block.level.label}"
        directory.mkdir(parents=True, exist_ok=True)
        doc = result_json(block, model, tokenizer_id, workload, run_id, slos, burstiness)
        doc["run_number"] = block.block
        path = directory / f"run={block.block}.json"
        path.write_text(json.dumps(doc))
        written.append(path)
        groups.setdefault(directory, []).append(doc)
    for directory, docs in groups.items():
        (directory / "summary.json").write_text(json.dumps(docs, indent=1))
        written.append(directory / "summary.json")
    return written
