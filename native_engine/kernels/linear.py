"""Linear layers y = x @ W.T through the kernel chosen for the machine, weights packed once.

Kinds:
- "aten": `F.linear` on the plain weight (MKL sgemm for fp32 on CPU; cuBLAS on CUDA).
- "onednn": the weight reordered once into oneDNN's blocked layout
  (`mkldnn._reorder_linear_weight`) and run by `mkldnn._linear_pointwise`, as Inductor's
  freezing and vLLM CPU do; on AMX / AVX512-BF16 machines this is the bf16 path. oneDNN packs
  bf16 weights only where the CPU has avx512bw/vl/dq or avx_ne_convert.
- "widened": bf16 on a CPU without bf16 matrix units. A few rows (a decode) run the bf16
  weight (aten's bf16 GEMV: half the bytes of fp32, and a decode is bound by weight bytes);
  more rows run fp32 SGEMM on a float32 copy of the same bf16 values, the output rounded
  back to bf16. Both compute bf16 inputs with fp32 accumulation and round once, so they
  agree up to summation order; the model then holds its weights twice (bf16 + fp32).

`choose_linear` picks per dtype and device; see its docstring for what was measured.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LINEAR_KINDS = ("aten", "onednn", "widened")

# Up to this many rows a widened linear runs the bf16 GEMV. The 30 layers' linears of
# SmolLM2 (1 thread, 2-core AVX2 EPYC, medians of 5 interleaved): bf16 against fp32 39 vs
# 70 ms at 1 row, 70 vs 111 at 2, 133 vs 124 at 4, 291 vs 198 at 8, 1,998 vs 433 at 64.
GEMV_ROWS = 2


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN can pack a weight of `dtype` on this CPU (probed on a tiny weight)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), 1)
    except RuntimeError:
        return False
    return True


def choose_linear(dtype: torch.dtype, device: torch.device) -> str:
    """oneDNN-packed bf16 on CPUs that pack it (the AMX / AVX512-BF16 machines; not measurable
    on the AVX2 development machine), widened bf16 on CPUs that do not (aten's bf16 GEMM there
    is 4-9x slower than fp32 past a few rows), aten everywhere else."""
    if device.type == "cpu" and dtype == torch.bfloat16:
        return "onednn" if onednn_packs(dtype) else "widened"
    return "aten"


class Linear:
    """One weight [out, in] and its kernel; calling it computes x @ W.T for x [2-D, in].
    `weight` is what the kernel reads: the plain tensor for aten, the packed one for oneDNN
    (the plain one is then dropped, so a packed model holds its weights once); `wide` is the
    float32 copy a widened linear runs past GEMV_ROWS rows (None for the other kinds)."""

    __slots__ = ("kind", "weight", "wide")

    def __init__(self, weight: torch.Tensor, kind: str) -> None:
        if kind not in LINEAR_KINDS:
            raise ValueError(f"linear kind must be one of {LINEAR_KINDS}, got {kind!r}")
        if kind == "widened" and weight.dtype != torch.bfloat16:
            raise ValueError(f"a widened linear takes a bf16 weight, got {weight.dtype}")
        self.kind = kind
        self.weight = (torch.ops.mkldnn._reorder_linear_weight(weight, 1) if kind == "onednn"
                       else weight)
        self.wide = weight.float() if kind == "widened" else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.wide is not None and x.shape[0] > GEMV_ROWS:
            return F.linear(x.float(), self.wide).to(x.dtype)
        if self.kind == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")
        return F.linear(x, self.weight)
