"""The Triton backend: what `select_backend` returns for "triton" (same names as torch_ref),
plus the per-step `plan` / per-layer `attend` pair the model calls (as torch_fast's)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from native_engine.kernels.triton_attention import INTERPRETED, paged_attention
from native_engine.kernels.triton_store import store_kv

__all__ = ["INTERPRETED", "StepPlan", "attend", "paged_attention", "plan", "store_kv"]


@dataclass(frozen=True)
class StepPlan:
    """The contract's per-step tensors; the kernels read them on the device, no host work."""

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor


def plan(slot_mapping: torch.Tensor, block_tables: torch.Tensor, query_start_loc: torch.Tensor,
         context_lens: torch.Tensor, block_size: int, num_blocks: int | None = None) -> StepPlan:
    return StepPlan(slot_mapping, block_tables, query_start_loc, context_lens)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
           v_cache: torch.Tensor, step: StepPlan, scale: float) -> torch.Tensor:
    """Store the step's k, v, then the varlen paged attention over the caches."""
    store_kv(k, v, k_cache, v_cache, step.slot_mapping)
    return paged_attention(q, k_cache, v_cache, step.block_tables, step.query_start_loc,
                           step.context_lens, scale)
