"""Batched CPU implementation of the paged-attention contract of `torch_ref`.

Same contract and signatures as `native_engine.kernels.torch_ref` (which stays the oracle).
The difference is how decodes run: torch_ref loops over requests in Python (two gathers and
two small matmuls per request per layer), which at 64 concurrent decodes cost more than the
model's matmuls. Here every decode row of the step is gathered at once, padded to the
longest context, and attended with one batched matmul pair under a key-padding mask.
Prefill chunks (more than one new token) still go one request at a time through torch_ref.

Padding reads a real slot of the same request (its last position), never an unowned slot,
so NaN or stale values elsewhere in the cache cannot leak in through a zero weight.

Determinism: a decode's output equals torch_ref's within fp32 rounding, but it is not
bitwise independent of the rest of the batch (the padded reduction length follows the
batch's longest context). torch_ref is the batch-invariant path.
"""

from __future__ import annotations

import torch

from native_engine.kernels.torch_ref import _prefill_attention, gather_kv, store_kv

__all__ = ["decode_slots", "paged_attention", "store_kv"]


def decode_slots(
    block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots [R, L] of each request's positions 0..L-1 (L: the longest context) and the
    valid mask [R, L]. Positions past a request's context repeat its last slot."""
    ctx = context_lens.long()
    pos = torch.arange(int(ctx.max()), dtype=torch.int64)
    valid = pos.unsqueeze(0) < ctx.unsqueeze(1)
    clamped = torch.minimum(pos.unsqueeze(0), (ctx - 1).unsqueeze(1))
    blocks = block_tables.long().gather(1, clamped // block_size)
    return blocks * block_size + clamped % block_size, valid


def _batched_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per request: q [R, Hq, D] → [R, Hq, D], computed in fp32."""
    num_reqs, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    slots, valid = decode_slots(block_tables, context_lens, k_cache.shape[1])
    k = k_cache.view(-1, num_kv_heads, head_dim)[slots].float()  # [R, L, Hkv, D]
    v = v_cache.view(-1, num_kv_heads, head_dim)[slots].float()
    qg = q.float().view(num_reqs, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    scores = (qg @ k.permute(0, 2, 3, 1)) * scale  # [R, Hkv, G, L]
    scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    out = scores.softmax(-1) @ v.permute(0, 2, 1, 3)  # [R, Hkv, G, D]
    return out.reshape(num_reqs, num_q_heads, head_dim).to(q.dtype)


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
    q_lens = query_start_loc.diff()
    decode = (q_lens == 1).nonzero().squeeze(1)
    if decode.numel():
        rows = query_start_loc[decode].long()
        out[rows] = _batched_decode(
            q[rows], k_cache, v_cache, block_tables[decode], context_lens[decode], scale
        )
    if decode.numel() == q_lens.numel():
        return out
    starts = query_start_loc.tolist()
    for r in (q_lens > 1).nonzero().squeeze(1).tolist():
        q_lo, q_hi, ctx = starts[r], starts[r + 1], int(context_lens[r])
        k = gather_kv(k_cache, block_tables[r], ctx).to(q.dtype)
        v = gather_kv(v_cache, block_tables[r], ctx).to(q.dtype)
        out[q_lo:q_hi] = _prefill_attention(q[q_lo:q_hi], k, v, scale)
    return out
