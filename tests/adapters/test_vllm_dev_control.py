"""Dev-mode control client against the 0.32.0 imitation (real loopback sockets)."""

from __future__ import annotations

import pytest

from adapters.vllm.dev_control import (
    DevControlCall,
    DevControlConfig,
    DevControlDisabledError,
    ResetOutcome,
    VLLMDevControl,
)
from schemas.engine import EngineError
from tests.adapters.vllm_imitation import Imitation, start_imitation


async def control(state: Imitation, enabled: bool = True):
    runner, base_url = await start_imitation(state)
    audit: list[DevControlCall] = []
    return runner, VLLMDevControl(DevControlConfig(base_url, enabled=enabled), audit.append), audit


@pytest.mark.parametrize(
    ("body", "outcome"),
    [
        ('{"success":true}', ResetOutcome.SUCCEEDED),
        ('{"success":false}', ResetOutcome.FAILED),
        ("", ResetOutcome.UNKNOWN),
        ('{"other":1}', ResetOutcome.UNKNOWN),
    ],
)
async def test_reset_outcomes(body: str, outcome: ResetOutcome) -> None:
    state = Imitation(reset_body=body)
    runner, client, audit = await control(state)
    try:
        result = await client.reset_prefix_cache()
    finally:
        await runner.cleanup()
    assert result.outcome is outcome and result.status == 200
    assert [(c.action, c.outcome) for c in audit] == [("reset_prefix_cache", outcome)]
    assert [(m, p) for m, p, _, _ in state.received] == [("POST", "/reset_prefix_cache")]


async def test_dev_mode_off_is_a_failure_and_probe_says_so() -> None:
    state = Imitation(dev_mode=False)
    runner, client, audit = await control(state)
    try:
        assert (await client.reset_prefix_cache()).outcome is ResetOutcome.FAILED
        assert not await client.probe()
    finally:
        await runner.cleanup()
    assert len(audit) == 2


async def test_probe_does_not_reset() -> None:
    state = Imitation()
    runner, client, _ = await control(state)
    try:
        assert await client.probe()
    finally:
        await runner.cleanup()
    assert [m for m, _, _, _ in state.received] == ["GET"]


async def test_disabled_by_default_refuses_before_any_socket() -> None:
    state = Imitation()
    runner, base_url = await start_imitation(state)
    audit: list[DevControlCall] = []
    client = VLLMDevControl(DevControlConfig(base_url), audit.append)
    try:
        with pytest.raises(DevControlDisabledError):
            await client.reset_prefix_cache()
    finally:
        await runner.cleanup()
    assert state.received == [] and audit[0].detail.startswith("refused")


async def test_unreachable_engine_raises_502_and_is_audited() -> None:
    audit: list[DevControlCall] = []
    client = VLLMDevControl(DevControlConfig("http://127.0.0.1:9", enabled=True), audit.append)
    with pytest.raises(EngineError) as err:
        await client.reset_prefix_cache()
    assert err.value.status == 502 and len(audit) == 1
