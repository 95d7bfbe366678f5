"""NativeDriver's liveness is the engine loop's (issue 11), over the tiny real Llama with faults
injected into the real engine: `alive()` and `ready()` are False while the loop restarts or
once it is dead, `liveness()` says why; a restarting engine still takes requests (they wait
for it), a dead one is refused with 503. (Traffic goes through the driver's engine, so these
tests do not depend on the shape of `generate()`.)"""

from __future__ import annotations

import asyncio

import pytest

from adapters.native import NativeDriver, NativeDriverConfig
from native_engine.async_engine import (
    EngineDeadError,
    EngineState,
    RequestFailedError,
    SupervisorConfig,
)
from native_engine.config import EngineConfig
from native_engine.engine import LLMEngine
from native_engine.request import SamplingParams
from schemas.engine import Determinism, EngineError
from tests.native_engine.tiny_model import random_model


class InjectedFault(RuntimeError):
    pass


def fail_always(*args: object) -> None:
    raise InjectedFault("injected")


async def driver(**supervisor: float) -> NativeDriver:
    config = EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=32,
                          dtype="float32", attention_backend="torch", scheduling_policy="priority")
    engine = LLMEngine.from_config(config, loaded=random_model(seed=3))
    d = NativeDriver(NativeDriverConfig(engine=config, served_model_name="tiny",
                                        supervisor=SupervisorConfig(**supervisor)), engine)
    await d.start()
    return d


async def drain(d: NativeDriver, rid: str) -> int:
    """Tokens generated for a short greedy request."""
    assert d.engine is not None
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = [out async for out in d.engine.generate([5, 6, 7], params, rid)]
    return outs[-1].num_output_tokens


async def until(d: NativeDriver, state: EngineState) -> None:
    for _ in range(500):
        live = d.liveness()
        if live is not None and live.state is state:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never {state}: {d.liveness()}")


async def test_declares_determinism_unavailable() -> None:
    """No batch invariance is claimed: torch_fast pads a step's decodes to its longest
    context, and a widened bf16 or onednn_gemm fp32 linear runs a different kernel past
    GEMV_ROWS or SGEMV_ROWS rows (tests/native_engine/test_llama_ops.py), so a request's
    numerics follow its batch."""
    d = await driver()
    try:
        assert d.capabilities.determinism is Determinism.UNAVAILABLE
    finally:
        await d.close()


async def test_alive_follows_a_restart(monkeypatch: pytest.MonkeyPatch) -> None:
    d = await driver(backoff_s=0.5)
    try:
        assert await d.alive() and await d.ready()
        assert d.engine is not None
        monkeypatch.setattr(d.engine.engine.scheduler, "schedule", fail_always)
        with pytest.raises(RequestFailedError):
            await drain(d, "in-flight")
        assert not await d.alive() and not await d.ready()
        assert d.liveness().state is EngineState.RESTARTING  # type: ignore[union-attr]
        assert (await d.models())["data"][0]["id"] == "tiny"  # not refused while restarting
        assert await drain(d, "during-restart") == 4  # queued, then served by the rebuilt loop
        assert await d.alive() and d.liveness().restarts == 1  # type: ignore[union-attr]
    finally:
        await d.close()
    assert not await d.alive()


async def test_a_crash_loop_leaves_it_dead_and_saying_why(
        monkeypatch: pytest.MonkeyPatch) -> None:
    d = await driver(max_restarts=1, backoff_s=0.01)
    try:
        assert d.engine is not None
        monkeypatch.setattr(d.engine.engine.scheduler, "schedule", fail_always)
        monkeypatch.setattr(d.engine.engine, "rebuild", fail_always)
        with pytest.raises(RequestFailedError):
            await drain(d, "a")
        await until(d, EngineState.DEAD)
        assert not await d.alive() and not await d.ready()
        assert "InjectedFault" in (d.liveness().reason or "")  # type: ignore[union-attr]
        with pytest.raises(EngineDeadError):
            await drain(d, "b")
        with pytest.raises(EngineError) as caught:
            await d.models()
        assert caught.value.status == 503
    finally:
        await d.close()
