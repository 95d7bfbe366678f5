"""BlockPool: allocation, refcounts, free-list integrity under random operation sequences."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from native_engine.kvcache.block_pool import BlockPool


def test_slot_formula() -> None:
    pool = BlockPool(8, 4)
    table = [5, 2, 7]
    assert [pool.slot(table, p) for p in range(10)] == [20, 21, 22, 23, 8, 9, 10, 11, 28, 29]
    assert pool.slots(table, 3, 6) == [23, 8, 9]
    assert pool.blocks_for(0) == 0 and pool.blocks_for(4) == 1 and pool.blocks_for(5) == 2


def test_allocate_free_and_errors() -> None:
    pool = BlockPool(4, 2)
    blocks = pool.allocate(3)
    assert len(set(blocks)) == 3 and pool.num_free == 1 and pool.usage == 0.75
    with pytest.raises(MemoryError):
        pool.allocate(2)
    pool.incref(blocks[:1])
    pool.decref(blocks)
    assert pool.num_free == 3 and pool.refcount(blocks[0]) == 1
    pool.decref(blocks[:1])
    with pytest.raises(RuntimeError, match="double free"):
        pool.decref(blocks[:1])
    with pytest.raises(RuntimeError, match="incref of free"):
        pool.incref(blocks[:1])
    pool.check_integrity({})


class PoolMachine(RuleBasedStateMachine):
    """Holders are lists of blocks; the pool's refcounts must equal the holder counts."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(12, 4)
        self.holders: list[list[int]] = []

    @rule(n=st.integers(0, 5))
    def allocate(self, n: int) -> None:
        if n > self.pool.num_free:
            with pytest.raises(MemoryError):
                self.pool.allocate(n)
            return
        self.holders.append(self.pool.allocate(n))

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def share(self, data: st.DataObject) -> None:
        src = data.draw(st.sampled_from(self.holders))
        self.pool.incref(src)
        self.holders.append(list(src))

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.holders) - 1))
        self.pool.decref(self.holders.pop(i))

    @invariant()
    def consistent(self) -> None:
        refs: dict[int, int] = {}
        for blocks in self.holders:
            for b in blocks:
                refs[b] = refs.get(b, 0) + 1
        self.pool.check_integrity(refs)
        assert self.pool.num_free == self.pool.num_blocks - len(refs)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)
