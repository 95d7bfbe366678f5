"""Unified varlen paged attention in Triton: one launch for a step's prefill chunks and decodes.

Contract in torch_ref. Layout of the launch:
- grid = (q-blocks, Hkv). Request r owns q-blocks starting at `query_start_loc[r] // BLOCK_Q + r`
  (disjoint across requests, total at most T // BLOCK_Q + R); a program finds its request by
  binary search over `query_start_loc`, so the host needs no per-step mapping and no sync.
- a program holds BLOCK_Q tokens x GROUP query heads of one KV head (grouped-query attention:
  the heads sharing a KV head read each K/V tile once) as BLOCK_M rows (row = token*GROUP + head).
- it streams the request's keys in tiles of TILE_N positions, looking each position's physical
  block up in the block table (any page size works), with an online softmax in fp32.
- head_dim is padded to a power of two and masked.
Data-dependent inputs are trusted (context_lens[r] >= new tokens of r, block tables cover
context_lens): checking them would cost a device sync per step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# Whether the kernels below are decorated for Triton's CPU interpreter: fixed when this module
# is imported, so TRITON_INTERPRET=1 must be set before that.
INTERPRETED: bool = triton.knobs.runtime.interpret


@triton.jit
def _find_request(query_start_loc_ptr, num_requests, q_block, BLOCK_Q: tl.constexpr):
    """Largest r with query_start_loc[r] // BLOCK_Q + r <= q_block."""
    lo = 0
    hi = num_requests
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    block_tables_ptr, query_start_loc_ptr, context_lens_ptr,
    qk_scale_log2, num_requests,
    stride_q_token, stride_q_head, stride_o_token, stride_o_head,
    stride_k_block, stride_k_slot, stride_k_head,
    stride_v_block, stride_v_slot, stride_v_head,
    stride_table,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    UPCAST_DOT: tl.constexpr, PRECISION: tl.constexpr,
):
    # UPCAST_DOT: dot operands are rounded to q's dtype as on the GPU, then multiplied in fp32
    # (same products, fp32 accumulation); set only under the interpreter, whose bf16 dot is broken.
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    r = _find_request(query_start_loc_ptr, num_requests, q_block, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + r)
    n_new = tl.load(query_start_loc_ptr + r + 1) - q_start
    q_block_local = q_block - (q_start // BLOCK_Q + r)
    if q_block_local * BLOCK_Q >= n_new:
        return
    ctx = tl.load(context_lens_ptr + r)

    rows = tl.arange(0, BLOCK_M)
    token = q_block_local * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (token < n_new)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q_token = (q_start + token).to(tl.int64)
    q = tl.load(
        q_ptr + q_token[:, None] * stride_q_token + head[:, None] * stride_q_head + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :], other=0.0,
    )
    position = ctx - n_new + token  # every row, padding included, sees key 0: no all-masked row

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    last_token = tl.minimum((q_block_local + 1) * BLOCK_Q, n_new) - 1
    kv_end = ctx - n_new + last_token + 1
    table_row = block_tables_ptr + r.to(tl.int64) * stride_table
    for start in range(0, kv_end, TILE_N):
        key_pos = start + tl.arange(0, TILE_N)
        key_ok = key_pos < kv_end
        block = tl.load(table_row + key_pos // PAGE, mask=key_ok, other=0).to(tl.int64)
        slot = key_pos % PAGE
        k = tl.load(
            k_cache_ptr + block[None, :] * stride_k_block + slot[None, :] * stride_k_slot
            + kv_head * stride_k_head + dims[:, None],
            mask=dim_ok[:, None] & key_ok[None, :], other=0.0,
        )
        k = k.to(q.dtype)
        if UPCAST_DOT:
            s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k, input_precision=PRECISION)
        s = s * qk_scale_log2
        visible = (key_pos[None, :] <= position[:, None]) & key_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + block[:, None] * stride_v_block + slot[:, None] * stride_v_slot
            + kv_head * stride_v_head + dims[None, :],
            mask=key_ok[:, None] & dim_ok[None, :], other=0.0,
        ).to(q.dtype)
        p = p.to(v.dtype)
        if UPCAST_DOT:
            pv = tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p, v, input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    acc = acc / l_i[:, None]
    o_token = (q_start + token).to(tl.int64)
    tl.store(
        out_ptr + o_token[:, None] * stride_o_token + head[:, None] * stride_o_head + dims[None, :],
        acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :],
    )


def _check_attention_args(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    query_start_loc: torch.Tensor, context_lens: torch.Tensor,
) -> None:
    if q.dim() != 3 or q.stride(2) != 1:
        raise ValueError(f"q must be [T, Hq, D] with a contiguous last axis; got {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache and v_cache must both be [num_blocks, block_size, Hkv, D]")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("the KV caches need a contiguous head_dim axis")
    if k_cache.shape[3] != q.shape[2] or q.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(
            f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)}: "
            "head_dim must match and Hq must be a multiple of Hkv"
        )
    num_requests = context_lens.shape[0]
    if query_start_loc.shape != (num_requests + 1,) or block_tables.shape[0] != num_requests:
        raise ValueError("query_start_loc must have R+1 entries and block_tables R rows")
    for name, t in (("block_tables", block_tables), ("query_start_loc", query_start_loc),
                    ("context_lens", context_lens)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")


def launch_shape(group: int, block_m: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_Q): a power of two >= 16 rows (tl.dot), BLOCK_Q tokens of `group` heads."""
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
    block_m = max(block_m, triton.next_power_of_2(group))
    return block_m, block_m // group


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    block_m: int = 16,
    tile_n: int = 32,
) -> torch.Tensor:
    """See torch_ref. `block_m` query rows (tokens x grouped heads) and `tile_n` key positions
    per step are tuning knobs (powers of two >= 16); results do not depend on them beyond
    floating-point summation order."""
    if tile_n < 16 or tile_n & (tile_n - 1):
        raise ValueError(f"tile_n must be a power of two >= 16, got {tile_n}")
    _check_attention_args(q, k_cache, v_cache, block_tables, query_start_loc, context_lens)
    out = torch.empty_like(q)
    num_tokens, num_q_heads, head_dim = q.shape
    num_requests = context_lens.shape[0]
    if num_tokens == 0 or num_requests == 0:
        return out
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    block_m, block_q = launch_shape(group, block_m)
    block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    grid = (num_tokens // block_q + num_requests, num_kv_heads)
    _paged_attention_kernel[grid](
        out, q, k_cache, v_cache, block_tables, query_start_loc, context_lens,
        scale * LOG2E, num_requests,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        PAGE=k_cache.shape[1], BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=tile_n,
        UPCAST_DOT=INTERPRETED and q.dtype == torch.bfloat16,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out
