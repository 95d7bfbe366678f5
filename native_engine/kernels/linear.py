"""Linear layers y = x @ W.T through the kernel chosen for the machine, weights packed once.

Kinds:
- "aten": `F.linear` on the plain weight (MKL sgemm for fp32 on CPU; cuBLAS on CUDA).
- "onednn": the weight reordered once into oneDNN's blocked layout
  (`mkldnn._reorder_linear_weight`) and run by `mkldnn._linear_pointwise`, as Inductor's
  freezing and vLLM CPU do; on AMX / AVX512-BF16 machines this is the bf16 path. oneDNN packs
  bf16 weights only where the CPU has avx512bw/vl/dq or avx_ne_convert.
- "widened": bf16 on a CPU without bf16 matrix units. A few rows (a decode) run the bf16
  weight (aten's bf16 GEMV: half the bytes of fp32, and a decode is bound by weight bytes);
  more rows run an fp32 GEMM on a float32 copy of the same bf16 values (oneDNN-packed where
  oneDNN packs fp32, as "onednn_gemm" does, else aten's), the output rounded back to bf16.
  Both compute bf16 inputs with fp32 accumulation and round once, so they agree up to
  summation order; the model then holds its weights twice (bf16 + fp32).
- "onednn_gemm": float32 on an x86 CPU. One row (a batch-1 decode) runs MKL's SGEMV: on an
  [in, out] copy (`torch.mm(x, W.T)`, the weight read row by row into the output) where the
  output is at least as wide as the input, on the plain weight (one dot product per output)
  where it is narrower. SmolLM2's 30 layers plus its lm_head at one row (1 thread, 2-core
  AVX2 EPYC, medians of 7 interleaved, distinct weights so none stays in cache): plain
  weights 40.9 ms, this mix 30.5 ms, oneDNN-packed 38.4 ms; the lm_head alone 10.2 -> 5.6
  ms; the down projection (1,536 -> 576) 226 us plain against 297 us transposed. The copy
  replaces the plain weight. More rows run a oneDNN-packed copy (`mkldnn._linear_pointwise`),
  whose fp32 GEMMs beat MKL's on the same machine (SmolLM2, 1 thread, an engine of each side
  by side, 3 interleaved rounds, medians, against "aten": cold 1,000-token TTFT 5.99 -> 5.66
  s, concurrent 120-token prompts 23.1 -> 25.5 tok/s at 16 and 30.0 -> 34.2 at 64; at 2, 3
  and 4 rows the packed copy took 41, 48 and 50 ms against the mix's 47, 63 and 85). The
  kinds differ in summation order only (fp32, ~1e-4). The model holds its weights twice:
  `fak serve`'s peak RSS 2,280 -> 3,044 MiB there, 3,213 MiB with the [in, out] copies (the
  loaded weights stay mapped while the model keeps views of them; copying those too took the
  resident size after start-up 3,213 -> 2,820 MiB but the peak to 3,335, and a container is
  sized by its peak).

`choose_linear` picks per dtype and device; see its docstring for what was measured.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

LINEAR_KINDS = ("aten", "onednn", "widened", "onednn_gemm")

# Up to this many rows a widened linear runs the bf16 GEMV. The 30 layers' linears of
# SmolLM2 (1 thread, 2-core AVX2 EPYC, medians of 5 interleaved): bf16 against fp32 39 vs
# 70 ms at 1 row, 70 vs 111 at 2, 133 vs 124 at 4, 291 vs 198 at 8, 1,998 vs 433 at 64.
GEMV_ROWS = 2
# An onednn_gemm linear runs MKL for one row only. The same linears plus the lm_head, fp32,
# MKL against oneDNN-packed (medians of 5 interleaved): 88 vs 102 ms at 1 row, 150 vs 105
# at 2, 205 vs 111 at 3, 203 vs 146 at 8, 281 vs 220 at 16.
SGEMV_ROWS = 1


@functools.cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN can pack a weight of `dtype` on this CPU (probed on a tiny weight, once)."""
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
    is 4-9x slower than fp32 past a few rows); fp32 GEMMs through oneDNN on x86 CPUs (AVX2 or
    AVX-512) that pack fp32; aten everywhere else (CUDA, other CPUs: not measured)."""
    if device.type == "cpu" and dtype == torch.bfloat16:
        return "onednn" if onednn_packs(dtype) else "widened"
    if (device.type == "cpu" and dtype == torch.float32
            and torch.backends.cpu.get_cpu_capability().startswith("AVX")
            and onednn_packs(dtype)):
        return "onednn_gemm"
    return "aten"


class Linear:
    """One weight [out, in] and its kernel; calling it computes x @ W.T for x [2-D, in].
    `weight` is what the kernel reads: the plain tensor for aten, the packed one for oneDNN
    (the plain one is then dropped, so a packed model holds its weights once); `wide` is what
    a widened or onednn_gemm linear runs past `few_rows` rows (GEMV_ROWS, SGEMV_ROWS): a
    float32 copy, oneDNN-packed when `packed_wide` (None for the other kinds). `transposed`:
    `weight` is the [in, out] copy an onednn_gemm linear's single rows run."""

    __slots__ = ("few_rows", "kind", "packed_wide", "transposed", "weight", "wide")

    def __init__(self, weight: torch.Tensor, kind: str) -> None:
        if kind not in LINEAR_KINDS:
            raise ValueError(f"linear kind must be one of {LINEAR_KINDS}, got {kind!r}")
        if kind == "widened" and weight.dtype != torch.bfloat16:
            raise ValueError(f"a widened linear takes a bf16 weight, got {weight.dtype}")
        if kind == "onednn_gemm" and weight.dtype != torch.float32:
            raise ValueError(f"an onednn_gemm linear takes a float32 weight, got {weight.dtype}")
        self.kind = kind
        self.transposed = kind == "onednn_gemm" and weight.shape[0] >= weight.shape[1]
        self.weight = (torch.ops.mkldnn._reorder_linear_weight(weight, 1) if kind == "onednn"
                       else weight.t().contiguous() if self.transposed else weight)
        wide = weight.float() if kind in ("widened", "onednn_gemm") else None
        self.packed_wide = wide is not None and (kind == "onednn_gemm"
                                                 or onednn_packs(torch.float32))
        self.wide = (torch.ops.mkldnn._reorder_linear_weight(wide)
                     if wide is not None and self.packed_wide else wide)
        self.few_rows = SGEMV_ROWS if kind == "onednn_gemm" else GEMV_ROWS

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.wide is not None and x.shape[0] > self.few_rows:
            x32 = x.float()
            out = (torch.ops.mkldnn._linear_pointwise(x32, self.wide, None, "none", [], "")
                   if self.packed_wide else F.linear(x32, self.wide))
            return out.to(x.dtype)
        if self.kind == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")
        if self.transposed:
            return torch.mm(x, self.weight)
        return F.linear(x, self.weight)
