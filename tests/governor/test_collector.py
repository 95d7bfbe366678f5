"""The collector as `fak serve` leaves it once serving (governor.serve.settle_collector)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from governor.serve import YOUNG_COLLECTION_ALLOCATIONS, settle_collector


@pytest.fixture
def restored_collector() -> Iterator[None]:
    threshold = gc.get_threshold()
    gc.unfreeze()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def tracked(obj: object) -> bool:
    return any(o is obj for generation in range(3) for o in gc.get_objects(generation))


def test_start_up_objects_leave_the_collectors_view(restored_collector: None) -> None:
    built_at_start = [[i] for i in range(3)]
    assert tracked(built_at_start)
    settle_collector()
    assert not tracked(built_at_start)
    assert gc.get_freeze_count() > 0
    assert tracked([[]])  # what requests allocate later is collected as before


def test_young_collections_are_rarer(restored_collector: None) -> None:
    young, middle, old = gc.get_threshold()
    settle_collector()
    assert gc.get_threshold() == (YOUNG_COLLECTION_ALLOCATIONS, middle, old)
    assert young < YOUNG_COLLECTION_ALLOCATIONS
