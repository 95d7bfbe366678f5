"""What every `fak bench` output directory must hold, checked the same way everywhere."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from schemas.validate import validate

PNG = b"\x89PNG\r\n\x1a\n"
VLLM_KEYS = ("date", "backend", "label", "model_id", "num_prompts", "request_rate",
             "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
             "total_output_tokens", "request_throughput", "request_goodput",
             "output_throughput", "total_token_throughput", "input_lens", "output_lens",
             "ttfts", "itls", "latencies", "start_times", "errors", "mean_ttft_ms",
             "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_itl_ms", "mean_e2el_ms",
             "max_output_tokens_per_s", "max_concurrent_requests")


def check_outputs(out: Path, arms: tuple[str, ...], levels: tuple[str, ...]) -> list[dict]:
    """Artifacts validate and name the plan's hash; vLLM-format files per arm and block
    carry vLLM's keys; plots are non-empty PNGs; the report leads with the verdicts."""
    plan_sha = hashlib.sha256((out / "plan.json").read_bytes()).hexdigest()
    docs = []
    for path in sorted((out / "artifacts").glob("*.json")):
        doc = json.loads(path.read_text())
        validate("ab_artifact", doc)
        assert doc["workload"]["plan_sha256"] == plan_sha
        if not doc["comparison"]["claim_allowed"]:
            assert doc["comparison"]["ratio"] is None and doc["comparison"]["reasons"]
        docs.append(doc)
    assert len(docs) == len(levels) * (len(arms) - 1)
    for arm in arms:
        for level in levels:
            runs = sorted((out / "vllm" / f"{arm}-{level}").glob("run=*.json"))
            assert runs
            for run in runs:
                data = json.loads(run.read_text())
                assert set(VLLM_KEYS) <= set(data), set(VLLM_KEYS) - set(data)
                assert len(data["ttfts"]) == data["num_prompts"]
            summary = json.loads((out / "vllm" / f"{arm}-{level}" / "summary.json").read_text())
            assert len(summary) == len(runs)
    pngs = [out / f"ttft_ecdf-{lv}.png" for lv in levels] + \
        [out / f"itl_ecdf-{lv}.png" for lv in levels] + [out / "throughput.png",
                                                         out / "ttft_vs_load.png"]
    for png in pngs:
        data = png.read_bytes()
        assert data.startswith(PNG) and len(data) > 2000, png
    report = (out / "report.md").read_text()
    assert report.index("## Verdicts") < report.index("## Plan")
    return docs
