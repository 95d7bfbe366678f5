"""The workloads `fak bench ab` sends: exact lengths, the same work for every arm, and
prompts no other block or run has sent (so a server's cache from a last run cannot make a
'cold' request warm)."""

from __future__ import annotations

import pytest

from governor.bench.config import WorkloadConfig
from governor.bench.workloads import BenchTokenizer, PlannedBlock, WorkloadGenerator

BLOCK = 16  # vLLM's default block size: the reuse unit a chance collision would hit
WORKLOADS = {
    "random": WorkloadConfig(input_len=24, output_len=3, range_ratio=0.5),
    "prefix-repetition": WorkloadConfig("prefix-repetition", input_len=8, output_len=3,
                                        prefix_len=32, num_prefixes=2),
    "multi-turn": WorkloadConfig("multi-turn", input_len=12, output_len=4, turns=3),
    "tenant-mix": WorkloadConfig("tenant-mix", input_len=8, output_len=3, prefix_len=32,
                                 num_prefixes=2),
}


def blocks(config: WorkloadConfig, tok: BenchTokenizer, run_id: str, arm: str = "a",
           count: int = 6, requests: int = 16) -> list[PlannedBlock]:
    gen = WorkloadGenerator(config, tok, seed=0, run_id=run_id, tenants=2)
    return [gen.block("c16", b, arm, requests) for b in [*range(count), "warmup"]]


def first_blocks(planned: list[PlannedBlock]) -> set[tuple[int, ...]]:
    return {r.prompt_ids[:BLOCK] for p in planned for r in p.requests
            if len(r.prompt_ids) >= BLOCK}


@pytest.mark.parametrize("name", WORKLOADS)
def test_a_rerun_shares_no_cache_block_with_the_last_run(name: str,
                                                          tokenizer: BenchTokenizer) -> None:
    """Against a server that served the last run, a new run id's prompts find nothing: not
    one first block in common, by any arm (the old `random` met one in |allowed| per pair)."""
    config = WORKLOADS[name]
    last = first_blocks(blocks(config, tokenizer, "feedc0de12345678", "a")
                        + blocks(config, tokenizer, "feedc0de12345678", "b"))
    for run_id in ("0123456789abcdef", "fedcba9876543210", "00000000deadbeef"):
        now = first_blocks(blocks(config, tokenizer, run_id, "a")
                           + blocks(config, tokenizer, run_id, "b"))
        assert now and not now & last, f"{name}: run {run_id} met the last run's prompts"


@pytest.mark.parametrize("name", WORKLOADS)
def test_every_prompt_has_its_planned_length_and_every_arm_the_same_work(
        name: str, tokenizer: BenchTokenizer) -> None:
    config = WORKLOADS[name]
    a = blocks(config, tokenizer, "feedc0de12345678", "a")
    b = blocks(config, tokenizer, "feedc0de12345678", "b")
    for x, y in zip(a, b, strict=True):
        lengths_a = sorted(len(r.prompt_ids) for r in x.requests)
        assert lengths_a == sorted(len(r.prompt_ids) for r in y.requests)
        assert {r.prompt for r in x.requests}.isdisjoint(r.prompt for r in y.requests)
        for r in x.requests:
            assert tuple(tokenizer.encode(r.prompt)) == r.prompt_ids
    if name == "random":
        low, high = 12, 36
        assert all(low <= len(r.prompt_ids) <= high for p in a for r in p.requests)
    assert blocks(config, tokenizer, "feedc0de12345678", "a") == a, "not reproducible"
