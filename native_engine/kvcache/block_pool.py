"""BlockPool: fixed-size KV blocks with refcounts and a free list (docs/design.md §6).

Token `pos` of a request lives in slot `block_table[pos // B] * B + pos % B`.

Invariants (checked by `check_integrity`): a block is on the free list exactly once iff its
refcount is 0; refcounts are never negative; free + used == num_blocks. Holders (requests'
block tables, the radix cache) each own one reference per block they hold.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refcounts = [0] * num_blocks
        # FIFO: a freed block goes to the tail, so recently freed KV is overwritten last.
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def refcount(self, block: int) -> int:
        return self._refcounts[block]

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks (refcount 1 each); raises MemoryError if fewer are free."""
        if n < 0:
            raise ValueError("cannot allocate a negative number of blocks")
        if n > len(self._free):
            raise MemoryError(f"need {n} KV blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._refcounts[b] = 1
        return blocks

    def incref(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if self._refcounts[b] == 0:
                raise RuntimeError(f"incref of free block {b}")
            self._refcounts[b] += 1

    def decref(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if self._refcounts[b] <= 0:
                raise RuntimeError(f"double free of block {b}")
            self._refcounts[b] -= 1
            if self._refcounts[b] == 0:
                self._free.append(b)

    def blocks_for(self, num_tokens: int) -> int:
        """How many blocks hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def slot(self, block_table: list[int], pos: int) -> int:
        return block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    def slots(self, block_table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def check_integrity(self, expected_refs: Mapping[int, int] | None = None) -> None:
        """Raise AssertionError on a broken invariant; with `expected_refs` (block -> number of
        holders, as counted by the caller from every holder) refcounts must match exactly."""
        free = list(self._free)
        assert len(free) == len(set(free)), "a block is on the free list twice"
        free_set = set(free)
        for b, ref in enumerate(self._refcounts):
            assert ref >= 0, f"block {b} has negative refcount {ref}"
            assert (ref == 0) == (b in free_set), f"block {b}: refcount {ref} vs free list"
            if expected_refs is not None:
                want = expected_refs.get(b, 0)
                assert ref == want, f"block {b}: refcount {ref}, holders {want}"
