"""The shared value checks: `all_ints` answers what the loop over `is_int` answers."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from schemas.values import all_ints, is_int

VALUES = (st.integers() | st.booleans() | st.floats() | st.none() | st.text(max_size=3)
          | st.binary(max_size=3) | st.lists(st.integers(), max_size=2))


@given(st.lists(VALUES, max_size=12) | st.lists(st.integers(), max_size=40))
def test_all_ints_is_the_loop_over_is_int(values: list[Any]) -> None:
    assert all_ints(values) == all(is_int(v) for v in values)


def test_all_ints_edges() -> None:
    assert all_ints([]) and all_ints([0, -1, 2**80]) and all_ints(iter([3]))
    assert not all_ints([1, True]) and not all_ints([False]) and not all_ints([1.0])
