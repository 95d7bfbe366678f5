"""AsyncLLMEngine over the tiny real Llama: concurrent streams match the reference, a consumer
that goes away aborts its request, calls run between steps, a failing step fails the streams."""

from __future__ import annotations

import asyncio

import pytest

from native_engine.async_engine import AsyncLLMEngine, EngineDeadError
from native_engine.config import EngineConfig
from native_engine.engine import LLMEngine
from native_engine.model.loaded import LoadedModel
from native_engine.request import SamplingParams
from tests.native_engine.reference import ReferenceModel
from tests.native_engine.tiny_model import random_model


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return random_model(seed=3)


def build(loaded: LoadedModel) -> LLMEngine:
    cfg = EngineConfig(block_size=4, num_blocks=128, max_num_batched_tokens=32,
                       dtype="float32", attention_backend="torch")
    return LLMEngine.from_config(cfg, loaded=loaded)


async def collect(engine: AsyncLLMEngine, prompt: list[int], params: SamplingParams, rid: str):
    outs = [out async for out in engine.generate(prompt, params, rid)]
    return outs


async def test_concurrent_streams_match_reference(loaded: LoadedModel) -> None:
    ref = ReferenceModel(loaded.config, loaded.weights)
    engine = AsyncLLMEngine(build(loaded))
    await engine.start()
    try:
        ps = [[10 + i, 20, 30 + i, 40, 50] * (i + 1) for i in range(6)]
        params = SamplingParams(temperature=0, max_tokens=8)
        results = await asyncio.gather(*(collect(engine, p, params, f"r{i}")
                                         for i, p in enumerate(ps)))
        for p, outs in zip(ps, results, strict=True):
            ids = [t for o in outs for t in o.new_token_ids]
            assert ids == ref.greedy_generate(p, 8, engine.engine.eos_token_ids)
            assert outs[-1].finished and all(not o.finished for o in outs[:-1])
            assert "".join(o.text_delta for o in outs) == engine.engine.tokenizer.decode(
                ids, skip_special_tokens=True)
        again = await collect(engine, ps[3], params, "warm")
        assert again[-1].cached_tokens == len(ps[3]) - 1
        stats = await engine.stats()
        assert stats.num_running == 0 and stats.prefix_hit_tokens >= len(ps[3]) - 1
    finally:
        await engine.close()


async def test_consumer_leaving_aborts(loaded: LoadedModel) -> None:
    engine = AsyncLLMEngine(build(loaded))
    await engine.start()
    try:
        stream = engine.generate([5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True), "x")
        first = await stream.__anext__()
        assert not first.finished
        await stream.aclose()
        for _ in range(100):
            if not await engine.call(lambda e: e.has_unfinished()):
                break
            await asyncio.sleep(0.01)
        assert not await engine.call(lambda e: e.has_unfinished())
        await engine.call(lambda e: e.check_integrity())
        with pytest.raises(ValueError, match="Priority"):
            await collect(engine, [1], SamplingParams(priority=2), "bad")
    finally:
        await engine.close()


class BrokenRunner:
    def __init__(self, runner) -> None:
        self.inner = runner
        self.model_config = runner.model_config

    def execute(self, batch):
        raise RuntimeError("device lost")

    def copy_slots(self, src, dst) -> None:
        self.inner.copy_slots(src, dst)


async def test_failing_step_fails_streams(loaded: LoadedModel) -> None:
    inner = build(loaded)
    engine = AsyncLLMEngine(LLMEngine(inner.config, BrokenRunner(inner.runner), inner.tokenizer))
    await engine.start()
    try:
        with pytest.raises(EngineDeadError):
            await collect(engine, [1, 2, 3], SamplingParams(max_tokens=4), "a")
        with pytest.raises(EngineDeadError):
            await engine.stats()
    finally:
        await engine.close()
