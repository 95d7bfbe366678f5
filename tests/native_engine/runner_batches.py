"""Runner batches assembled by hand from per-request chunks (the engine builds its own)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from native_engine.model.runner import RunnerBatch


@dataclass(frozen=True)
class BatchChunk:
    """New tokens of one request: `token_ids` at positions start, start+1, ...; its KV
    blocks in `block_table` (enough to hold positions up to start + len - 1)."""

    token_ids: Sequence[int]
    start: int
    block_table: Sequence[int]


def runner_batch(chunks: Sequence[BatchChunk], block_size: int) -> RunnerBatch:
    """Assemble a batch from per-request chunks of new tokens."""
    if not chunks:
        raise ValueError("a batch needs at least one chunk")
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts = [0]
    for chunk in chunks:
        end = chunk.start + len(chunk.token_ids)
        if -(-end // block_size) > len(chunk.block_table):
            raise ValueError("block_table too short for the chunk's positions")
        ids.extend(chunk.token_ids)
        for pos in range(chunk.start, end):
            positions.append(pos)
            slots.append(chunk.block_table[pos // block_size] * block_size + pos % block_size)
        starts.append(len(ids))
    width = max(len(c.block_table) for c in chunks)
    tables = [list(c.block_table) + [0] * (width - len(c.block_table)) for c in chunks]
    return RunnerBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        context_lens=torch.tensor([c.start + len(c.token_ids) for c in chunks],
                                  dtype=torch.int32),
    )
