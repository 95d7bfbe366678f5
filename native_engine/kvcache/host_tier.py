"""HostTier: full KV blocks demoted from the device pool, kept in host RAM (medium "CPU").

The KV lives in one preallocated arena `[capacity, *block_shape]` (pinned when the device is
CUDA, so restores are plain DMA copies); each resident block owns one arena row. Blocks are
keyed by their salted chain digest (native_engine.kvcache.tier_entry), so a tenant can only
ever look up its own blocks.

Invariants (check_integrity): every resident entry owns exactly one row and no row is owned
twice; free rows + resident entries == capacity; the child index holds exactly the resident
entries; every entry is one full block of the arena's shape.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from native_engine.kvcache.tier_entry import MEDIUM_CPU, ChildIndex, TierEntry


class HostTier:
    medium = MEDIUM_CPU

    def __init__(self, capacity_blocks: int, block_shape: Sequence[int], dtype: torch.dtype,
                 pin_memory: bool = False) -> None:
        if capacity_blocks < 1:
            raise ValueError("the host tier needs room for at least one block")
        self.capacity = capacity_blocks
        self.block_shape = tuple(block_shape)
        self.block_size = self.block_shape[2]  # [layers, 2 (K, V), block_size, heads, dim]
        self.arena = torch.empty((capacity_blocks, *self.block_shape), dtype=dtype,
                                 pin_memory=pin_memory)
        self.block_bytes = self.arena[0].numel() * self.arena.element_size()
        self._rows: dict[bytes, int] = {}
        self._entries: dict[bytes, TierEntry] = {}
        self._free = list(range(capacity_blocks - 1, -1, -1))
        self.children = ChildIndex()

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        return len(self._entries) * self.block_bytes

    def get(self, digest: bytes) -> TierEntry | None:
        return self._entries.get(digest)

    def entries(self) -> list[TierEntry]:
        return list(self._entries.values())

    def kv(self, digest: bytes) -> torch.Tensor:
        """The block's KV (a view of its arena row)."""
        return self.arena[self._rows[digest]]

    def put(self, entry: TierEntry, kv: torch.Tensor) -> None:
        """Copy `kv` into a free row; the caller made room (MemoryError if none)."""
        if entry.digest in self._entries:
            raise ValueError("block already in the host tier")
        if not self._free:
            raise MemoryError("host tier full")
        if tuple(kv.shape) != self.block_shape:
            raise ValueError(f"KV block shape {tuple(kv.shape)} != {self.block_shape}")
        row = self._free.pop()
        self.arena[row].copy_(kv)
        self._rows[entry.digest] = row
        self._entries[entry.digest] = entry
        self.children.add(entry)

    def remove(self, digest: bytes) -> TierEntry | None:
        entry = self._entries.pop(digest, None)
        if entry is not None:
            self._free.append(self._rows.pop(digest))
            self.children.discard(entry)
        return entry

    def clear(self) -> list[TierEntry]:
        gone = list(self._entries.values())
        self._entries.clear()
        self._rows.clear()
        self.children.clear()
        self._free = list(range(self.capacity - 1, -1, -1))
        return gone

    def check_integrity(self) -> None:
        rows = list(self._rows.values())
        assert self._rows.keys() == self._entries.keys(), "rows and entries disagree"
        assert len(set(rows)) == len(rows), "an arena row is owned twice"
        assert not set(rows) & set(self._free) and len(set(self._free)) == len(self._free)
        assert len(rows) + len(self._free) == self.capacity, "arena rows leaked"
        for entry in self._entries.values():
            entry.check(self.block_size)
        self.children.check(self._entries.values())
