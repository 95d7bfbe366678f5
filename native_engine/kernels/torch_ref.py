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

The oracle of the contract (the CPU engine runs torch_fast, checked against this).
Requests are computed one at a time, so a request's output does not depend on what else is
in the batch. Decodes (one new token) use grouped matmuls in fp32; prefill chunks use
scaled_dot_product_attention with an explicit causal mask offset by the cached prefix
(is_causal would be wrong whenever a prefix is cached).
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


def _decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query token q [Hq, D] over k, v [ctx, Hkv, D], in fp32.

    Grouped heads share one matmul and the permuted views of k, v go to BLAS as strided
    operands, so nothing is copied beyond the gather (SDPA's GQA path was 1.2-2.9x slower
    here for one query on CPU).
    """
    num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    qg = q.float().view(num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    scores = (qg @ k.float().permute(1, 2, 0)) * scale  # [Hkv, G, ctx]
    out = scores.softmax(-1) @ v.float().permute(1, 0, 2)  # [Hkv, G, D]
    return out.reshape(num_q_heads, head_dim).to(q.dtype)


def _prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [n, Hq, D] are the last n of the ctx positions of k, v [ctx, Hkv, D]; causal."""
    n_new, ctx = q.shape[0], k.shape[0]
    pos = torch.arange(ctx - n_new, ctx).unsqueeze(1)
    mask = torch.arange(ctx).unsqueeze(0) <= pos  # [n, ctx]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        attn_mask=mask, scale=scale, enable_gqa=True,
    )
    return out.transpose(0, 1)


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
    for r, ctx in enumerate(context_lens.tolist()):
        q_lo, q_hi = starts[r], starts[r + 1]
        if q_hi == q_lo:
            continue
        k = gather_kv(k_cache, block_tables[r], ctx)
        v = gather_kv(v_cache, block_tables[r], ctx)
        if q_hi - q_lo == 1:
            out[q_lo] = _decode_attention(q[q_lo], k, v, scale)
        else:
            out[q_lo:q_hi] = _prefill_attention(
                q[q_lo:q_hi], k.to(q.dtype), v.to(q.dtype), scale
            )
    return out
