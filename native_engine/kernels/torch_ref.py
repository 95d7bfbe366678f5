"""Torch reference of the paged-attention contract (CPU path and test oracle).

Contract (shared with the Triton kernels):
- KV caches: `k_cache`, `v_cache` of shape [num_blocks, block_size, num_kv_heads, head_dim].
- `store_kv(k, v, k_cache, v_cache, slot_mapping)`: k, v are [T, Hkv, D]; token t is written
  to slot `slot_mapping[t]` (slot = block * block_size + offset); a slot of -1 is skipped.
- `paged_attention(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale)`:
  q is [T, Hq, D] holding the new tokens of R requests back to back; request r owns
  q[query_start_loc[r]:query_start_loc[r+1]] and has `context_lens[r]` tokens in total
  (cached + new, all already stored). Its new tokens sit at the last positions, so query i
  of a request with n new tokens is at position context_len - n + i and attends to keys
  [0, position] (causal). Hq must be a multiple of Hkv (grouped-query attention).
  Returns [T, Hq, D] in q's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    flat_k[slots] = k[keep].to(k_cache.dtype)
    flat_v[slots] = v[keep].to(v_cache.dtype)


def gather_kv(
    cache: torch.Tensor, block_table: torch.Tensor, length: int
) -> torch.Tensor:
    """The first `length` tokens of one request's cache, [length, Hkv, D]."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]
    return blocks.reshape(-1, *cache.shape[2:])[:length]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    for r, ctx in enumerate(lens):
        q_lo, q_hi = starts[r], starts[r + 1]
        n_new = q_hi - q_lo
        if n_new == 0:
            continue
        k = gather_kv(k_cache, block_tables[r], ctx).to(q.dtype)
        v = gather_kv(v_cache, block_tables[r], ctx).to(q.dtype)
        qr = q[q_lo:q_hi].transpose(0, 1)  # [Hq, n, D]
        kr = k.transpose(0, 1)  # [Hkv, ctx, D]
        vr = v.transpose(0, 1)
        mask = None
        if n_new > 1:
            pos = torch.arange(ctx - n_new, ctx).unsqueeze(1)
            mask = torch.arange(ctx).unsqueeze(0) <= pos  # [n, ctx]
        o = F.scaled_dot_product_attention(
            qr, kr, vr, attn_mask=mask, scale=scale, enable_gqa=True
        )
        out[q_lo:q_hi] = o.transpose(0, 1)
    return out
