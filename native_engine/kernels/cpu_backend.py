"""The CPU backend: torch_fast's layout, its attention through fak's C kernels.

Decodes (one new token per request) and prefill chunks read their paged K and V where they
lie (after the step's own are stored), in float32 arithmetic, one request at a time
(`cpu_native.decode_attention`, `cpu_native.prefill_attention`), so a request's output does
not depend on the rest of the batch. `select_backend` returns this module for "cpu", and for
"auto" on a CPU where the kernels built.

On a CPU with AMX a bf16 prompt of `SDPA_PREFILL_TOKENS` or more with nothing cached before
it goes to SDPA's flash kernel instead, causal over the step's own K and V, on every usable
core: its bf16 GEMMs run on the AMX tiles. Per layer, SmolLM2's heads, 2-core Xeon with AMX
(medians of 7): 4.7 against the C kernel's 6.9 ms at 1,000 tokens, 9.3 against 24.1 at
2,000; outputs within one bf16 rounding. Still one request per call, so still independent
of the batch. Whole prefill steps there (medians of 6, interleaved; C kernel against SDPA):
1 x 1,000 tokens 574 vs 453 ms, 2 x 1,000 697 vs 497, 4 x 500 545 vs 467, 1 x 400 120 vs
105, 1 x 300 99 vs 97, 1 x 200 65 vs 66, 1 x 120 45 vs 48, 16 x 120 382 vs 393: short
prompts stay with the C kernel. (Without AMX the C kernel is the faster everywhere: 14.5
against 27.6 ms a layer at 1,000 tokens on the AVX512-BF16 EPYC.)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from native_engine.kernels import cpu_native, torch_fast
from native_engine.kernels.cpu_features import AMX_BF16
from native_engine.kernels.linear import on_wide_threads
from native_engine.kernels.torch_ref import store_kv as store_kv

__all__ = ["StepPlan", "attend", "decode_dtype", "paged_attention", "plan", "store_kv"]

SDPA_PREFILL_TOKENS = 384  # a fresh bf16 prompt this long takes SDPA on AMX (above)


@dataclass(frozen=True)
class StepPlan:
    """torch_fast's layout (planned without SDPA masks) and its decodes, checked once for
    every layer of the step (None: no decodes)."""

    layout: torch_fast.StepPlan
    decodes: cpu_native.DecodeTables | None


def kernels() -> cpu_native.CpuKernels:
    loaded = cpu_native.load()
    if loaded is None:
        raise RuntimeError("the cpu attention backend needs fak's CPU kernels, which did not "
                           "build here (see the log line 'cpu kernels: off'); use "
                           "--attention-backend torch")
    return loaded


def decode_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a decode attends in: the kernel computes in float32."""
    return torch.float32


def plan(
    slot_mapping: torch.Tensor | None,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    num_blocks: int | None = None,
) -> StepPlan:
    """torch_fast's plan for kernels that read the caches, its decode tables checked against
    `num_blocks` (the caches' size; required when the step has decodes)."""
    layout = torch_fast.plan(slot_mapping, block_tables, query_start_loc, context_lens,
                             block_size, sdpa=False)
    if layout.decode_blocks is None or layout.decode_ctx is None:
        return StepPlan(layout, None)
    if num_blocks is None:
        raise ValueError("the cpu backend checks decode block ids against num_blocks")
    return StepPlan(layout, cpu_native.DecodeTables.checked(
        layout.decode_blocks, layout.decode_ctx, num_blocks, block_size))


def attend(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
           k_cache: torch.Tensor, v_cache: torch.Tensor, step: StepPlan,
           scale: float) -> torch.Tensor:
    """torch_fast.attend's contract, through the kernels."""
    loaded, decodes = kernels(), step.decodes

    def decode(rows: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
               _layout: torch_fast.StepPlan, sc: float) -> torch.Tensor:
        assert decodes is not None
        return cpu_native.decode_attention(loaded, rows.contiguous(), kc, vc, decodes, sc)

    def prefill(rows: torch.Tensor, k_rows: torch.Tensor | None, v_rows: torch.Tensor | None,
                kc: torch.Tensor, vc: torch.Tensor, p: torch_fast.Prefill,
                sc: float) -> torch.Tensor:
        assert p.blocks is not None  # planned with sdpa=False: every prefill has its blocks
        if (AMX_BF16 and rows.dtype == torch.bfloat16 and p.ctx == p.hi - p.lo
                and p.ctx >= SDPA_PREFILL_TOKENS and k_rows is not None and v_rows is not None):
            return on_wide_threads(torch_fast.sdpa_prefill, rows, k_rows, v_rows, kc, vc,
                                   replace(p, blocks=None), sc)
        return cpu_native.prefill_attention(loaded, rows, kc, vc, p.blocks, p.ctx, sc)

    return torch_fast.attend_with(decode, prefill, q, k, v, k_cache, v_cache, step.layout,
                                  scale)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """The torch_ref contract: the caches already hold every token's K and V."""
    step = plan(None, block_tables, query_start_loc, context_lens, k_cache.shape[1],
                k_cache.shape[0])
    return attend(q, None, None, k_cache, v_cache, step, scale)
