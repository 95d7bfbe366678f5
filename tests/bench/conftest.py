"""Shared fixtures of the bench tests: the embedded model's tokenizer (read once) and a
runner that measures two fake upstreams through `fak bench ab`'s own machinery."""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from governor.bench.ab import Measured, ab_phases, measure, open_arms
from governor.bench.artifact import host_facts
from governor.bench.config import ABConfig, ArmSpec, WorkloadConfig
from governor.bench.workloads import BenchTokenizer, load_tokenizer

from .fake_upstream import FakeUpstream, FakeUpstreamConfig, serving

RunPair = Callable[..., Awaitable[Measured]]


@pytest.fixture(scope="session")
def tokenizer() -> BenchTokenizer:
    return load_tokenizer(None)


@pytest.fixture
def run_pair(tokenizer: BenchTokenizer, tmp_path: Path) -> RunPair:
    """Measure arms a and b (fake upstreams with the given configs) at one level."""
    count = 0

    async def run(a: FakeUpstreamConfig, b: FakeUpstreamConfig, *, seed: int = 0,
                  order: str = "interleaved", blocks: int = 8, requests: int = 8,
                  concurrency: int = 8, metric: str = "ttft.p50", run_id: str | None = None,
                  upstreams: tuple[FakeUpstream, FakeUpstream] | None = None,
                  names: tuple[str, str] = ("a", "b"),
                  settle: tuple[float, float] = (0.2, 0.0)) -> Measured:
        """`settle`: (max busy share, timeout); off unless a test is about it."""
        nonlocal count
        count += 1
        pair = upstreams or (FakeUpstream(a, tokenizer), FakeUpstream(b, tokenizer))
        async with serving(*pair) as urls:
            config = ABConfig(
                arms=tuple(ArmSpec(n, u) for n, u in zip(names, urls, strict=True)),
                out=tmp_path / f"run{count}",
                workload=WorkloadConfig(input_len=24, output_len=3),
                concurrency=(concurrency,), blocks=blocks, requests_per_block=requests,
                warmup_requests=2, seed=seed, order=order, metric=metric,  # type: ignore[arg-type]
                bootstrap_resamples=400, ratios=(metric,), settle_max_busy=settle[0],
                settle_timeout_s=settle[1], progress=False)
            handles = await open_arms(list(config.arms), config, [], None,
                                      tokenizer.front_tokens)
            try:
                return await measure(config, ab_phases(config), handles, [],
                                     run_id or secrets.token_hex(8), host_facts(), tokenizer)
            finally:
                for h in handles:
                    await h.session.close()

    return run
