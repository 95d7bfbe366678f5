"""Triton KV-store kernel: new K/V rows into the paged caches by slot (contract: torch_ref)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_k_token,
    stride_v_token,
    ROW: tl.constexpr,
    ROW_PAD: tl.constexpr,
):
    """One program per token: copy its Hkv*D values to `slot * ROW` in both caches."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    cols = tl.arange(0, ROW_PAD)
    # Hkv * D need not be a power of two (SmolLM2: 3 * 64 = 192): pad the range and mask.
    in_row = cols < ROW
    k = tl.load(k_ptr + token * stride_k_token + cols, mask=in_row)
    v = tl.load(v_ptr + token * stride_v_token + cols, mask=in_row)
    tl.store(k_cache_ptr + slot * ROW + cols, k.to(k_cache_ptr.dtype.element_ty), mask=in_row)
    tl.store(v_cache_ptr + slot * ROW + cols, v.to(v_cache_ptr.dtype.element_ty), mask=in_row)


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """[T, Hkv, D] with each token's Hkv*D values contiguous (a strided token axis is fine)."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()


def _check_store_args(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(
            f"k and v must both be [T, Hkv, D]; got {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache and v_cache must both be [num_blocks, block_size, Hkv, D]")
    if tuple(k.shape[1:]) != tuple(k_cache.shape[2:]):
        raise ValueError(f"k is {tuple(k.shape)} but the cache holds {tuple(k_cache.shape[2:])}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV caches must be contiguous")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError("slot_mapping must be an int32/int64 vector with one slot per token")


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    _check_store_args(k, v, k_cache, v_cache, slot_mapping)
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    k, v = _rows_contiguous(k), _rows_contiguous(v)
    row = k.shape[1] * k.shape[2]
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0),
        ROW=row, ROW_PAD=triton.next_power_of_2(row),
    )
