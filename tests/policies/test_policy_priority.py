"""Tenant class → engine priority (with direction) and admission rank."""

from __future__ import annotations

import pytest

from policies.priority import PriorityConfig, admission_rank, engine_priority
from schemas.engine import EngineCapabilities, PriorityDirection

CONFIG = PriorityConfig()


def caps(on: bool, direction: PriorityDirection = PriorityDirection.LOWER_IS_SOONER):
    return EngineCapabilities(
        engine_kind="vllm", model_id="m", priority_scheduling=on, priority_direction=direction
    )


def test_admission_rank_orders_classes() -> None:
    ranks = [admission_rank(CONFIG, c) for c in ("interactive", "standard", "batch", "background")]
    assert ranks == [0, 1, 2, 3]


def test_lower_is_sooner_values() -> None:
    values = {c: engine_priority(CONFIG, c, caps(True)) for c in CONFIG.classes}
    assert values == {"interactive": -1, "standard": 0, "batch": 1, "background": 2}


def test_higher_is_sooner_values() -> None:
    high = caps(True, PriorityDirection.HIGHER_IS_SOONER)
    values = {c: engine_priority(CONFIG, c, high) for c in CONFIG.classes}
    assert values == {"interactive": 1, "standard": 0, "batch": -1, "background": -2}


@pytest.mark.parametrize("direction", list(PriorityDirection))
def test_engine_order_matches_admission_order(direction: PriorityDirection) -> None:
    engine = caps(True, direction)
    values = [engine_priority(CONFIG, c, engine) for c in CONFIG.classes]
    sooner_first = sorted(values, reverse=direction is PriorityDirection.HIGHER_IS_SOONER)
    assert values == sooner_first and len(set(values)) == len(values)


@pytest.mark.parametrize("direction", list(PriorityDirection))
def test_nothing_emitted_without_priority_scheduling(direction: PriorityDirection) -> None:
    for tenant_class in CONFIG.classes:
        assert engine_priority(CONFIG, tenant_class, caps(False, direction)) is None
    # The governor's own queue still orders classes.
    assert admission_rank(CONFIG, "interactive") < admission_rank(CONFIG, "batch")


def test_unknown_class_is_a_clear_error_even_when_capability_is_off() -> None:
    with pytest.raises(ValueError, match="unknown tenant class 'vip'"):
        engine_priority(CONFIG, "vip", caps(False))
    with pytest.raises(ValueError, match="unknown tenant class"):
        admission_rank(CONFIG, "Interactive")


def test_custom_classes_and_baseline() -> None:
    config = PriorityConfig(classes=("realtime", "interactive", "batch"), baseline="batch")
    assert [engine_priority(config, c, caps(True)) for c in config.classes] == [-2, -1, 0]


@pytest.mark.parametrize(
    ("classes", "baseline"),
    [
        ((), "standard"),
        (("a", "a"), "a"),
        (("a", "b"), "c"),
        (("Bad Name",), "Bad Name"),
        (("",), ""),
    ],
)
def test_bad_config_is_refused(classes: tuple[str, ...], baseline: str) -> None:
    with pytest.raises(ValueError):
        PriorityConfig(classes=classes, baseline=baseline)
