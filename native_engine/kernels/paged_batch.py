"""Random mixed batches in the paged-attention layout, for kernel tests and the GPU bench.

Every cache slot a request does not own (spare blocks, the unused tail of a partial block,
the block that pads short block-table rows) holds `poison` (NaN by default), so a kernel that
reads outside a request's context shows it in its output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

POISON_BLOCK = 0  # physical block kept poisoned; block-table rows are padded with it


@dataclass(frozen=True)
class PagedBatch:
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, page_size, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [R, max_blocks] int32
    query_start_loc: torch.Tensor  # [R + 1] int32
    context_lens: torch.Tensor  # [R] int32
    scale: float

    def attention_args(self) -> tuple:
        """Positional arguments of `paged_attention`."""
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.query_start_loc,
                self.context_lens, self.scale)

    def to(self, dtype: torch.dtype) -> PagedBatch:
        """Same batch with q and the caches cast to `dtype` (index tensors untouched)."""
        return PagedBatch(self.q.to(dtype), self.k_cache.to(dtype), self.v_cache.to(dtype),
                          self.block_tables, self.query_start_loc, self.context_lens, self.scale)


def _check_lengths(new_lens: Sequence[int], context_lens: Sequence[int]) -> None:
    if len(new_lens) != len(context_lens) or not new_lens:
        raise ValueError("need one new-token count and one context length per request (R >= 1)")
    for n, ctx in zip(new_lens, context_lens, strict=True):
        if n < 0 or ctx < n:
            raise ValueError(f"request with {n} new tokens and context {ctx}: need 0 <= n <= ctx")


def make_paged_batch(
    new_lens: Sequence[int],
    context_lens: Sequence[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    spare_blocks: int = 2,
    poison: float = float("nan"),
) -> PagedBatch:
    """Requests r = 0..R-1 with `new_lens[r]` new tokens at the end of `context_lens[r]`.

    Physical blocks are shuffled (block 0 stays the poison block), so tables are not ranges.
    """
    _check_lengths(new_lens, context_lens)
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-ctx // page_size) for ctx in context_lens]
    num_blocks = 1 + sum(blocks_per_req) + spare_blocks
    physical = (1 + torch.randperm(num_blocks - 1, generator=gen)).tolist()
    shape = (num_blocks, page_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, poison, dtype=torch.float32)
    v_cache = torch.full(shape, poison, dtype=torch.float32)
    tables = torch.full((len(new_lens), max(1, *blocks_per_req)), POISON_BLOCK, dtype=torch.int32)
    for r, ctx in enumerate(context_lens):
        row = [physical.pop() for _ in range(blocks_per_req[r])]
        tables[r, : len(row)] = torch.tensor(row, dtype=torch.int32)
        pos = torch.arange(ctx)
        slots = tables[r, pos // page_size].long() * page_size + pos % page_size
        for cache in (k_cache, v_cache):
            cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(
                ctx, num_kv_heads, head_dim, generator=gen)
    starts = torch.tensor([0, *new_lens], dtype=torch.int64).cumsum(0).to(torch.int32)
    q = torch.randn(int(starts[-1]), num_q_heads, head_dim, generator=gen)
    return PagedBatch(
        q.to(dtype=dtype, device=device), k_cache.to(dtype=dtype, device=device),
        v_cache.to(dtype=dtype, device=device), tables.to(device), starts.to(device),
        torch.tensor(list(context_lens), dtype=torch.int32, device=device), head_dim**-0.5,
    )
