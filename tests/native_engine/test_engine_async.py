"""AsyncLLMEngine over the tiny real Llama: concurrent streams match the reference, a consumer
that goes away aborts its request, calls run between steps; failures (issue 11): a failed
forward or add fails only its requests, a cancelled call is skipped, a crashed loop is
restarted by the supervisor (in-flight streams get an error, later requests work), and a
crash loop ends in a dead engine that says why. Faults are injected into the real engine."""

from __future__ import annotations

import asyncio
import threading

import pytest

from native_engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineState,
    RequestFailedError,
    SupervisorConfig,
)
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


class InjectedFault(RuntimeError):
    pass


def fail_always(*args: object) -> None:
    raise InjectedFault("injected")


LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


async def wait_for_state(engine: AsyncLLMEngine, state: EngineState) -> None:
    for _ in range(500):
        if engine.liveness().state is state:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine never became {state}: {engine.liveness()}")


async def test_a_failed_forward_fails_its_streams_and_the_engine_goes_on(
        loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    ref = ReferenceModel(loaded.config, loaded.weights)
    engine = AsyncLLMEngine(build(loaded))
    await engine.start()
    try:
        real = engine.engine.runner.execute
        monkeypatch.setattr(engine.engine.runner, "execute", fail_always)
        with pytest.raises(RequestFailedError) as caught:
            await collect(engine, [1, 2, 3], SHORT, "a")
        assert isinstance(caught.value.__cause__, InjectedFault)
        assert engine.is_alive
        monkeypatch.setattr(engine.engine.runner, "execute", real)
        outs = await collect(engine, [1, 2, 3], SHORT, "b")
        assert [t for o in outs for t in o.new_token_ids] == ref.greedy_generate([1, 2, 3], 6, ())
        await engine.call(lambda e: e.check_integrity())
    finally:
        await engine.close()
    assert engine.liveness().state is EngineState.STOPPED and not engine.is_alive


async def test_a_failing_add_fails_that_request_only(
        loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = AsyncLLMEngine(build(loaded))
    await engine.start()
    try:
        real = engine.engine.add_request

        def faulty(prompt, params, request_id):
            if request_id == "victim":
                raise InjectedFault("add")
            return real(prompt, params, request_id)

        monkeypatch.setattr(engine.engine, "add_request", faulty)
        other = asyncio.create_task(collect(engine, [4, 5, 6], SHORT, "other"))
        with pytest.raises(RequestFailedError):
            await collect(engine, [1, 2, 3], SHORT, "victim")
        assert (await other)[-1].num_output_tokens == 6
        assert engine.is_alive
    finally:
        await engine.close()


async def test_a_call_cancelled_before_it_runs_does_not_kill_the_loop(
        loaded: LoadedModel) -> None:
    """Its future is cancelled: setting its result used to raise in the worker and end it."""
    engine = AsyncLLMEngine(build(loaded))
    await engine.start()
    try:
        gate, inside = threading.Event(), threading.Event()

        def hold(_: LLMEngine) -> bool:
            inside.set()
            return gate.wait(10)

        blocker = asyncio.create_task(engine.call(hold))
        while not inside.is_set():
            await asyncio.sleep(0.01)
        ran: list[int] = []
        gone = asyncio.create_task(engine.call(lambda e: ran.append(1)))
        await asyncio.sleep(0.01)
        gone.cancel()
        for _ in range(3):
            await asyncio.sleep(0)
        gate.set()
        assert await blocker
        assert await engine.call(lambda e: 2) == 2 and engine.is_alive and ran == []
    finally:
        await engine.close()


async def test_a_crashed_loop_is_restarted_and_later_requests_work(
        loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    ref = ReferenceModel(loaded.config, loaded.weights)
    engine = AsyncLLMEngine(build(loaded), SupervisorConfig(max_restarts=3, backoff_s=0.3))
    await engine.start()
    try:
        streams = [engine.generate([7, 8, 9 + i], LONG, f"long{i}") for i in range(2)]
        for stream in streams:
            assert not (await anext(stream)).finished
        # A fault in this scheduler object (the rebuilt engine gets a fresh one).
        monkeypatch.setattr(engine.engine.scheduler, "schedule", fail_always)
        for stream in streams:
            with pytest.raises(RequestFailedError) as caught:
                async for _ in stream:
                    pass
            assert isinstance(caught.value.__cause__, InjectedFault)
        live = engine.liveness()
        assert (live.state, live.restarts) == (EngineState.RESTARTING, 0)
        assert live.reason is not None and "InjectedFault" in live.reason
        later = await collect(engine, [1, 2, 3], SHORT, "later")  # queued over the restart
        assert [t for o in later for t in o.new_token_ids] == ref.greedy_generate([1, 2, 3], 6,
                                                                                  ())
        live = engine.liveness()
        assert (live.state, live.restarts) == (EngineState.ALIVE, 1) and engine.is_alive
        await engine.call(lambda e: e.check_integrity())
        assert (await engine.stats()).num_running == 0
    finally:
        await engine.close()


async def test_a_crash_loop_ends_in_a_dead_engine_that_says_why(
        loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = AsyncLLMEngine(build(loaded), SupervisorConfig(max_restarts=2, backoff_s=0.01))
    await engine.start()
    try:
        monkeypatch.setattr(engine.engine.scheduler, "schedule", fail_always)
        monkeypatch.setattr(engine.engine, "rebuild", fail_always)  # every restart crashes
        with pytest.raises(RequestFailedError):
            await collect(engine, [1, 2, 3], SHORT, "a")
        await wait_for_state(engine, EngineState.DEAD)
        live = engine.liveness()
        assert live.restarts == 2 and not live.alive and "InjectedFault" in (live.reason or "")
        with pytest.raises(EngineDeadError, match="dead"):
            await engine.stats()
        with pytest.raises(EngineDeadError):
            await collect(engine, [1, 2, 3], SHORT, "b")
    finally:
        await engine.close()
    assert engine.liveness().state is EngineState.DEAD
