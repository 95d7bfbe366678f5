"""Batched CPU implementation of the paged-attention contract of `torch_ref`.

Two entry points:
- `paged_attention` / `store_kv`: the contract of `native_engine.kernels.torch_ref` (which
  stays the oracle), for tests and callers holding only the caches.
- `plan` once per step, then `attend` per layer: what the model runs. The plan does the
  host-side bookkeeping (which rows decode, which requests prefill, index tensors, masks)
  once instead of in every layer, and `attend` also gets the step's fresh K and V, so a
  prefill with nothing cached attends to them directly (`is_causal`: no mask, no gather).

Every attention is one `scaled_dot_product_attention` call on 4-D inputs (SDPA's flash CPU
kernel): all of a step's decodes at once, their blocks gathered and padded to the longest
context under a key-padding mask; a prefill chunk after a cached prefix with the causal
mask offset by the prefix. Positions past a context (the tail of a partial block, padding
blocks) are masked out and zeroed in the gathered K and V, so NaN or stale values there
cannot leak into the output.

Decodes on a CPU without AMX attend in float32 on upcast copies of q and the gathered K, V
(`DECODE_UPCAST`): SDPA's bf16 CPU kernel took 431 against 166 us for one query over 150
keys and 3.7 against 0.86 ms over 1,000 on the 2-core AVX2 EPYC, and 4.3 against 0.92 ms
for 16 decodes over 160 keys on the 2-core AVX512-BF16 EPYC (SmolLM2 heads, 1 thread); AMX
machines keep bf16 (not measured here). The result is rounded back to q's dtype once, as
the bf16 kernel's fp32 accumulation is. Prefill attention stays in the model's dtype (its
bf16 flash kernel measured no slower than fp32 on either machine). The `cpu` backend
(cpu_backend) runs these decodes through fak's C kernel instead.

Determinism: outputs equal torch_ref's within rounding, but a decode is not bitwise
independent of the rest of the batch (the padded key length follows the batch's longest
context). torch_ref is the batch-invariant path.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from native_engine.kernels.cpu_features import AMX_BF16
from native_engine.kernels.torch_ref import store_kv as store_kv

__all__ = ["DECODE_UPCAST", "StepPlan", "attend", "attend_with", "paged_attention", "plan",
           "store_kv"]

DECODE_UPCAST = not AMX_BF16


def decode_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a decode attends in: float32 for half precision on a CPU without AMX (see
    the module docstring), else the model's own."""
    if DECODE_UPCAST and device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return dtype


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
    blocks [Rd, nb] (int64) and contexts `decode_ctx` [Rd] (int64); for SDPA, the mask of
    positions inside each context [Rd, nb * block_size] and `decode_pad`, the flat indices
    of the positions outside (None: none), or `single_decode` (blocks, context) for a step
    of one decode alone (`sdpa=False` plans leave these three None). `prefills`: the
    multi-token requests.
    """

    store_slots: torch.Tensor | None
    store_rows: torch.Tensor | None
    decode_rows: torch.Tensor | None
    decode_blocks: torch.Tensor | None
    decode_ctx: torch.Tensor | None
    decode_valid: torch.Tensor | None
    decode_pad: torch.Tensor | None
    single_decode: tuple[torch.Tensor, int] | None
    prefills: tuple[Prefill, ...]

    @property
    def has_decodes(self) -> bool:
        return self.decode_blocks is not None


def plan(
    slot_mapping: torch.Tensor | None,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    num_blocks: int | None = None,
    sdpa: bool = True,
) -> StepPlan:
    """The step's layout (see StepPlan); every host-side list is read here, once.

    `slot_mapping` None: nothing is stored and every prefill reads its K/V from the caches
    (the `paged_attention` contract, where the caches already hold the step's tokens).
    `num_blocks` (the caches' size) is not needed here; other backends check against it.
    `sdpa` False plans for kernels that read everything from the caches: no SDPA masks, and
    every prefill gets its blocks."""
    starts = query_start_loc.tolist()
    ctxs = context_lens.tolist()
    lens = [hi - lo for lo, hi in itertools.pairwise(starts)]
    store_slots, store_rows = _store_layout(slot_mapping)
    tables = block_tables.long()

    def blocks_of(r: int) -> torch.Tensor:
        return tables[r, : -(-ctxs[r] // block_size)]

    fresh = slot_mapping is not None and sdpa
    decodes = [r for r, n in enumerate(lens) if n == 1]
    prefills = tuple(
        Prefill(starts[r], starts[r + 1], ctxs[r], None if fresh and ctxs[r] == n else blocks_of(r))
        for r, n in enumerate(lens) if n > 1
    )
    single = decode_rows = blocks = ctx = valid = pad = None
    if decodes:
        index = torch.tensor(decodes)
        width = -(-max(ctxs[r] for r in decodes) // block_size)
        blocks = tables[index, :width]
        ctx = context_lens.long()[index]
        if len(decodes) < len(lens):
            decode_rows = torch.tensor([starts[r] for r in decodes])
    if sdpa and len(decodes) == 1 and not prefills:
        single = (blocks_of(decodes[0]), ctxs[decodes[0]])
    elif sdpa and blocks is not None and ctx is not None:
        valid = torch.arange(blocks.shape[1] * block_size) < ctx.unsqueeze(1)
        pad = (~valid).flatten().nonzero().squeeze(1)
        pad = pad if pad.numel() else None
    return StepPlan(store_slots, store_rows, decode_rows, blocks, ctx, valid, pad, single,
                    prefills)


def _store_layout(
    slot_mapping: torch.Tensor | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if slot_mapping is None:
        return None, None
    keep = slot_mapping >= 0
    if bool(keep.all()):
        return slot_mapping, None
    return slot_mapping[keep], keep.nonzero().squeeze(1)


Decode = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, StepPlan, float], torch.Tensor]
PrefillFn = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor,
                      torch.Tensor, Prefill, float], torch.Tensor]


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
    return attend_with(sdpa_decode, sdpa_prefill, q, k, v, k_cache, v_cache, step, scale)


def attend_with(decode: Decode, prefill: PrefillFn, q: torch.Tensor, k: torch.Tensor | None,
                v: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor,
                step: StepPlan, scale: float) -> torch.Tensor:
    """`attend` with the step's decode rows attended by `decode(q_rows, k_cache, v_cache,
    step, scale)` and each prefill by `prefill(q_rows, k_rows, v_rows, k_cache, v_cache,
    the Prefill, scale)` (k_rows, v_rows: the step's own, None when not given)."""
    if k is not None and v is not None and step.store_slots is not None:
        _store(k, v, k_cache, v_cache, step)
    if step.has_decodes and step.decode_rows is None:  # decodes only
        return decode(q, k_cache, v_cache, step, scale)
    if not step.has_decodes and len(step.prefills) == 1:  # one prompt, e.g. a cold TTFT
        return prefill(q, k, v, k_cache, v_cache, step.prefills[0], scale)
    out = torch.empty_like(q)
    if step.has_decodes:
        rows = step.decode_rows
        out[rows] = decode(q[rows], k_cache, v_cache, step, scale)
    for p in step.prefills:
        rows_k = None if k is None else k[p.lo : p.hi]
        rows_v = None if v is None else v[p.lo : p.hi]
        out[p.lo : p.hi] = prefill(q[p.lo : p.hi], rows_k, rows_v, k_cache, v_cache, p, scale)
    return out


def sdpa_prefill(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, p: Prefill,
                 scale: float) -> torch.Tensor:
    """One prefill chunk through SDPA: causal over its own k, v when nothing before it is
    cached (`p.blocks` None), else over its gathered context under an offset causal mask."""
    if p.blocks is None:
        assert k is not None and v is not None  # a fresh prompt brings its own k, v
        return _attention(q, k, v, None, scale, causal=True)
    keys = _gather(k_cache, p.blocks).flatten(0, 1)[: p.ctx].to(q.dtype)
    values = _gather(v_cache, p.blocks).flatten(0, 1)[: p.ctx].to(q.dtype)
    pos = torch.arange(p.ctx - (p.hi - p.lo), p.ctx).unsqueeze(1)
    mask = torch.arange(p.ctx).unsqueeze(0) <= pos  # causal, offset by the prefix
    return _attention(q, keys, values, mask, scale)


def sdpa_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, step: StepPlan,
                scale: float) -> torch.Tensor:
    """The step's decode rows q [Rd, Hq, D] through SDPA (a plan made with masks)."""
    if step.single_decode is not None:
        blocks, ctx = step.single_decode
        dtype = decode_dtype(q.dtype, q.device)
        keys = _gather(k_cache, blocks).flatten(0, 1)[:ctx].to(dtype)
        values = _gather(v_cache, blocks).flatten(0, 1)[:ctx].to(dtype)
        return _attention(q.to(dtype), keys, values, None, scale).to(q.dtype)
    return _batched_decode(q, k_cache, v_cache, step, scale)


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """The cache's blocks [*blocks.shape, block_size, Hkv, D] for int64 ids of any shape.
    `index_select`, not `cache[blocks]`: advanced indexing took 3-5x as long (fp32 SmolLM2
    blocks, 1 thread, the 2-core AVX2 EPYC: 71 against 21 us for 12 blocks, 7.1 against
    2.5 ms for 64 x 16, once per layer for K and again for V)."""
    return cache.index_select(0, blocks.reshape(-1)).view(*blocks.shape, *cache.shape[1:])


def _store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           step: StepPlan) -> None:
    if step.store_rows is not None:
        k, v = k[step.store_rows], v[step.store_rows]
    k_cache.view(-1, *k_cache.shape[2:])[step.store_slots] = k.to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[step.store_slots] = v.to(v_cache.dtype)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               scale: float, causal: bool = False) -> torch.Tensor:
    """One request's q [n, Hq, D] over its k, v [ctx, Hkv, D] → [n, Hq, D]; `mask` [n, ctx]
    (True = attend) or `causal` (q and k the same positions), or neither (a decode).

    Inputs go in as 4-D [1, H, len, D]: SDPA takes its flash CPU kernel only for 4-D inputs
    (3-D fell back to the math path: 217 against 48 ms a layer for a 1,000-token prompt;
    with a mask 40 against 12 ms for 240 tokens after a 1,000-token prefix)."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def _batched_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    step: StepPlan, scale: float) -> torch.Tensor:
    """One query token per request: q [R, Hq, D] → [R, Hq, D], the step's decode blocks
    gathered to [R, L, Hkv, D] and attended in one SDPA call under the key-padding mask.

    Positions past a context are zeroed in the gathered K and V first (only those rows):
    SDPA adds the mask as -inf, and -inf + NaN would still be NaN. 64 decodes of 250
    tokens, SmolLM2 shapes, 1 thread: 11 ms a layer, against 23 ms for the earlier
    block-diagonal matmul pair and 15 ms for torch_ref's per-request loop.
    """
    assert step.decode_blocks is not None and step.decode_valid is not None
    num_reqs, num_q_heads, head_dim = q.shape
    length = step.decode_valid.shape[1]
    dtype = decode_dtype(q.dtype, q.device)
    k = _gather(k_cache, step.decode_blocks).view(num_reqs, length, *k_cache.shape[2:]).to(dtype)
    v = _gather(v_cache, step.decode_blocks).view(num_reqs, length, *v_cache.shape[2:]).to(dtype)
    if step.decode_pad is not None:
        k.view(num_reqs * length, -1).index_fill_(0, step.decode_pad, 0.0)
        v.view(num_reqs * length, -1).index_fill_(0, step.decode_pad, 0.0)
    out = F.scaled_dot_product_attention(
        q.to(dtype).view(num_reqs, num_q_heads, 1, head_dim), k.transpose(1, 2),
        v.transpose(1, 2), attn_mask=step.decode_valid.view(num_reqs, 1, 1, length),
        scale=scale, enable_gqa=True,
    )
    return out.view(num_reqs, num_q_heads, head_dim).to(q.dtype)


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
