"""Linear layers y = x @ W.T through the kernel chosen for the machine, weights packed once.

Kinds:
- "aten": `F.linear` on the plain weight (MKL sgemm for fp32 on CPU; cuBLAS on CUDA).
- "onednn": the weight reordered once into oneDNN's blocked layout
  (`mkldnn._reorder_linear_weight`) and run by `mkldnn._linear_pointwise`, as Inductor's
  freezing and vLLM CPU do; on AMX / AVX512-BF16 machines this is the bf16 path. oneDNN packs
  bf16 weights only where the CPU has avx512bw/vl/dq or avx_ne_convert.

`choose_linear` picks per dtype and device; see its docstring for what was measured.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LINEAR_KINDS = ("aten", "onednn")


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
    on the AVX2 development machine), aten everywhere else."""
    if device.type == "cpu" and dtype == torch.bfloat16 and onednn_packs(dtype):
        return "onednn"
    return "aten"


class Linear:
    """One weight [out, in] and its kernel; calling it computes x @ W.T for x [2-D, in].
    `weight` is what the kernel reads: the plain tensor for aten, the packed one for oneDNN
    (the plain one is then dropped, so a packed model holds its weights once)."""

    __slots__ = ("kind", "weight")

    def __init__(self, weight: torch.Tensor, kind: str) -> None:
        if kind not in LINEAR_KINDS:
            raise ValueError(f"linear kind must be one of {LINEAR_KINDS}, got {kind!r}")
        self.kind = kind
        self.weight = (torch.ops.mkldnn._reorder_linear_weight(weight, 1) if kind == "onednn"
                       else weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "aten":
            return F.linear(x, self.weight)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")
