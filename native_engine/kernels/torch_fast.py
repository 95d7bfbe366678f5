"""Batched CPU implementation of the paged-attention contract of `torch_ref`.

Two entry points:
- `paged_attention` / `store_kv`: the contract of `native_engine.kernels.torch_ref` (which
  stays the oracle), for tests and callers holding only the caches.
- `plan` once per step, then `attend` per layer: what the model runs. The plan does the
  host-side bookkeeping (which rows decode, which requests prefill, index tensors, masks)
  once instead of in every layer, and `attend` also gets the step's fresh K and V, so a
  prefill with nothing cached attends to them directly through
  `scaled_dot_product_attention(is_causal=True)` (the flash CPU kernel: no mask, no gather).

Decodes: every decode row of the step is gathered at once, padded to the longest context,
and attended with one batched matmul pair under a key-padding mask. A step of one decode
takes torch_ref's per-request path (fewer ops). Prefill chunks after a cached prefix
gather their request's blocks and use an explicit causal mask offset by the prefix.

Positions past a context (the tail of a partial block, padding blocks) are masked out of
the scores and zeroed in V, so NaN or stale values there cannot leak into the output.

Determinism: a decode's output equals torch_ref's within fp32 rounding, but it is not
bitwise independent of the rest of the batch (the padded reduction length follows the
batch's longest context). torch_ref is the batch-invariant path.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from native_engine.kernels.torch_ref import _decode_attention, _prefill_attention
from native_engine.kernels.torch_ref import store_kv as store_kv

__all__ = ["StepPlan", "attend", "gather_blocks", "paged_attention", "plan", "store_kv"]


@dataclass(frozen=True)
class Prefill:
    """One request with more than one new token: q rows [lo, hi), `ctx` tokens in all.
    `blocks` (int64 block ids covering ctx) is None when nothing before the chunk is cached."""

    lo: int
    hi: int
    ctx: int
    blocks: torch.Tensor | None


@dataclass(frozen=True)
class StepPlan:
    """One step's attention layout, the same for every layer.

    store_slots: slots written (those >= 0 of slot_mapping; None: nothing to store);
    store_rows: the k/v rows written there, None meaning all rows in order. Decodes (one
    new token): q rows `decode_rows` (None: every row is a decode, in request order), their
    blocks [Rd, nb] and the mask of positions inside each context [Rd, nb * block_size];
    `single_decode` (blocks, context) is a step of one decode alone. `prefills`: the
    multi-token requests.
    """

    store_slots: torch.Tensor | None
    store_rows: torch.Tensor | None
    decode_rows: torch.Tensor | None
    decode_blocks: torch.Tensor | None
    decode_valid: torch.Tensor | None
    single_decode: tuple[torch.Tensor, int] | None
    prefills: tuple[Prefill, ...]


def plan(
    slot_mapping: torch.Tensor | None,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
) -> StepPlan:
    """The step's layout (see StepPlan); every host-side list is read here, once.

    `slot_mapping` None: nothing is stored and every prefill reads its K/V from the caches
    (the `paged_attention` contract, where the caches already hold the step's tokens)."""
    starts = query_start_loc.tolist()
    ctxs = context_lens.tolist()
    lens = [hi - lo for lo, hi in itertools.pairwise(starts)]
    store_slots, store_rows = _store_layout(slot_mapping)
    tables = block_tables.long()

    def blocks_of(r: int) -> torch.Tensor:
        return tables[r, : -(-ctxs[r] // block_size)]

    fresh = slot_mapping is not None
    decodes = [r for r, n in enumerate(lens) if n == 1]
    prefills = tuple(
        Prefill(starts[r], starts[r + 1], ctxs[r], None if fresh and ctxs[r] == n else blocks_of(r))
        for r, n in enumerate(lens) if n > 1
    )
    single = decode_rows = blocks = valid = None
    if len(decodes) == 1 and not prefills:
        single = (blocks_of(decodes[0]), ctxs[decodes[0]])
    elif decodes:
        index = torch.tensor(decodes)
        width = -(-max(ctxs[r] for r in decodes) // block_size)
        blocks = tables[index, :width]
        valid = torch.arange(width * block_size) < context_lens.long()[index].unsqueeze(1)
        if len(decodes) < len(lens):
            decode_rows = torch.tensor([starts[r] for r in decodes])
    return StepPlan(store_slots, store_rows, decode_rows, blocks, valid, single, prefills)


def _store_layout(
    slot_mapping: torch.Tensor | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if slot_mapping is None:
        return None, None
    keep = slot_mapping >= 0
    if bool(keep.all()):
        return slot_mapping, None
    return slot_mapping[keep], keep.nonzero().squeeze(1)


def attend(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    step: StepPlan,
    scale: float,
) -> torch.Tensor:
    """Store the step's k, v [T, Hkv, D] (None: planned without slots, nothing to store)
    and attend q [T, Hq, D] → [T, Hq, D] in q's dtype."""
    if k is not None and v is not None and step.store_slots is not None:
        _store(k, v, k_cache, v_cache, step)
    if step.single_decode is not None:
        blocks, ctx = step.single_decode
        keys = k_cache[blocks].flatten(0, 1)[:ctx]
        values = v_cache[blocks].flatten(0, 1)[:ctx]
        return _decode_attention(q[0], keys, values, scale).unsqueeze(0)
    if step.decode_valid is not None and step.decode_rows is None:  # decodes only
        return _batched_decode(q, k_cache, v_cache, step.decode_blocks, step.decode_valid, scale)
    if step.decode_valid is None and len(step.prefills) == 1 and step.prefills[0].blocks is None:
        return _causal_attention(q, k, v, scale)  # one fresh prompt: the cold-TTFT path
    out = torch.empty_like(q)
    if step.decode_valid is not None:
        rows = step.decode_rows
        out[rows] = _batched_decode(q[rows], k_cache, v_cache, step.decode_blocks,
                                    step.decode_valid, scale)
    for p in step.prefills:
        if p.blocks is None:
            out[p.lo : p.hi] = _causal_attention(q[p.lo : p.hi], k[p.lo : p.hi],
                                                 v[p.lo : p.hi], scale)
        else:
            keys = k_cache[p.blocks].flatten(0, 1)[: p.ctx].to(q.dtype)
            values = v_cache[p.blocks].flatten(0, 1)[: p.ctx].to(q.dtype)
            out[p.lo : p.hi] = _prefill_attention(q[p.lo : p.hi], keys, values, scale)
    return out


def _store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           step: StepPlan) -> None:
    if step.store_rows is not None:
        k, v = k[step.store_rows], v[step.store_rows]
    k_cache.view(-1, *k_cache.shape[2:])[step.store_slots] = k.to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[step.store_slots] = v.to(v_cache.dtype)


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """A whole prompt's q [n, Hq, D] over its own k, v [n, Hkv, D], causal."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        is_causal=True, scale=scale, enable_gqa=True,
    )
    return out.transpose(0, 1)


def gather_blocks(
    cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's blocks covering its context, [R, L, Hkv * D] with L the longest
    context rounded up to whole blocks, and the mask [R, L] of positions inside a context.

    Whole blocks are gathered (contiguous copies, faster here than slot by slot); positions
    past a context hold whatever their slot holds, so callers must mask them.
    """
    block_size = cache.shape[1]
    num_blocks = -(-int(context_lens.max()) // block_size)
    blocks = cache[block_tables[:, :num_blocks].long()]
    length = num_blocks * block_size
    valid = torch.arange(length) < context_lens.long().unsqueeze(1)
    return blocks.view(blocks.shape[0], length, -1), valid


def _batched_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    blocks: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per request: q [R, Hq, D] → [R, Hq, D], computed in fp32; `blocks`
    [R, nb] int64 and `valid` [R, nb * block_size] as in StepPlan.

    Keys and values stay in their gathered [R, L, Hkv * D] layout (no permuted copies):
    q is spread block-diagonally to [R, Hq, Hkv * D], zero outside its own KV head, so one
    batched matmul yields every head's scores and a second every head's output; the
    off-diagonal head pairs of the output are dropped. That is Hkv times the (small)
    attention FLOPs, cheaper here than copying K and V into head-major order.
    """
    num_reqs, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    length = valid.shape[1]
    k = k_cache[blocks].view(num_reqs, length, -1).float()
    v = v_cache[blocks].view(num_reqs, length, -1).float()
    v.masked_fill_(~valid.unsqueeze(2), 0.0)  # 0 weight x NaN would still be NaN
    own_head = torch.eye(num_kv_heads, dtype=torch.float32).view(1, num_kv_heads, 1, -1, 1)
    q_spread = q.float().view(num_reqs, num_kv_heads, group, 1, head_dim) * own_head
    scores = q_spread.view(num_reqs, num_q_heads, -1) @ k.transpose(1, 2)  # [R, Hq, L]
    scores = scores.mul_(scale).masked_fill_(~valid.unsqueeze(1), float("-inf"))
    out = scores.softmax(-1) @ v  # [R, Hq, Hkv * D], every (q head, kv head) pair
    out = out.view(num_reqs, num_kv_heads, group, num_kv_heads, head_dim)
    own = out.diagonal(dim1=1, dim2=3)  # [R, G, D, Hkv]
    return own.permute(0, 3, 1, 2).reshape(num_reqs, num_q_heads, head_dim).to(q.dtype)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The torch_ref contract: the caches already hold every token's K and V."""
    step = plan(None, block_tables, query_start_loc, context_lens, k_cache.shape[1])
    return attend(q, None, None, k_cache, v_cache, step, scale)
