"""Determinism declarations: parsed, never inferred; garbage is unavailable."""

from __future__ import annotations

import inspect

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.determinism import is_recognised_determinism, parse_determinism
from schemas.engine import Determinism


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("batch_invariant", Determinism.BATCH_INVARIANT),
        ("  Batch-Invariant\n", Determinism.BATCH_INVARIANT),
        ("batch invariant", Determinism.BATCH_INVARIANT),
        ("DETERMINISTIC_OFFLINE", Determinism.DETERMINISTIC_OFFLINE),
        ("unavailable", Determinism.UNAVAILABLE),
        ("", Determinism.UNAVAILABLE),
        ("   ", Determinism.UNAVAILABLE),
        (None, Determinism.UNAVAILABLE),
        (b"batch_invariant", Determinism.UNAVAILABLE),
        (1, Determinism.UNAVAILABLE),
        ("temperature=0", Determinism.UNAVAILABLE),
        ("greedy", Determinism.UNAVAILABLE),
        ("deterministic", Determinism.UNAVAILABLE),
        ("batch_invariantx", Determinism.UNAVAILABLE),
        ("batch_ınvariant", Determinism.UNAVAILABLE),  # dotless i
        ("batch_invariant\x00", Determinism.UNAVAILABLE),
        ("batch_invariant" + " " * 100, Determinism.UNAVAILABLE),
    ],
)
def test_parse(raw: object, expected: Determinism) -> None:
    assert parse_determinism(raw) is expected


def test_recognised_flags_only_real_names() -> None:
    assert is_recognised_determinism("unavailable")
    assert not is_recognised_determinism("garbage")
    assert not is_recognised_determinism("")


def test_parser_takes_no_sampling_input() -> None:
    assert list(inspect.signature(parse_determinism).parameters) == ["raw"]


garbage = (
    st.text(max_size=80)
    | st.binary(max_size=40)
    | st.integers()
    | st.floats()
    | st.none()
    | st.lists(st.text(max_size=5), max_size=3)
    | st.dictionaries(st.text(max_size=5), st.integers(), max_size=3)
)


@settings(max_examples=200, deadline=None)
@given(raw=garbage)
def test_garbage_never_claims_determinism(raw: object) -> None:
    result = parse_determinism(raw)
    assert isinstance(result, Determinism)
    if result is not Determinism.UNAVAILABLE:
        assert isinstance(raw, str)
        assert raw.strip().lower().replace("-", "_").replace(" ", "_") == result.value


@settings(max_examples=100, deadline=None)
@given(prefix=st.text(max_size=5), suffix=st.text(max_size=5))
def test_decorated_names_are_not_accepted(prefix: str, suffix: str) -> None:
    raw = f"{prefix}batch_invariant{suffix}"
    if raw.strip().lower().replace("-", "_").replace(" ", "_") != "batch_invariant":
        assert parse_determinism(raw) is Determinism.UNAVAILABLE
