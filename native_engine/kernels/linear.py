"""Linear layers y = x @ W.T through the kernel chosen for the machine, weights packed once.

Kinds (by dtype and CPU, `choose_linear`), for the rows past `few_rows`:
- "aten": `F.linear` on the plain weight (MKL sgemm for fp32 on CPU; cuBLAS on CUDA).
- "onednn": the weight reordered once into oneDNN's blocked layout
  (`mkldnn._reorder_linear_weight`) and run by `mkldnn._linear_pointwise`, as Inductor's
  freezing and vLLM CPU do; on AMX / AVX512-BF16 machines this is the bf16 path. oneDNN packs
  bf16 weights only where the CPU has avx512bw/vl/dq or avx_ne_convert.
- "widened": bf16 on a CPU without bf16 matrix units: an fp32 GEMM on a float32 copy of the
  same bf16 values (oneDNN-packed where oneDNN packs fp32, else aten's), the output rounded
  back to bf16; bf16 inputs with fp32 accumulation, rounded once, as the GEMV below.
- "fak_gemm": bf16 on a CPU with AVX512-BF16 and no AMX: the weight packed once for fak's C
  GEMM (`cpu_native.gemm`: bf16 pairs, dot-product instructions, a register tile of rows),
  every row count, the weight held once. SmolLM2's 30 layers' linears, 1 thread, 2-core
  AVX512-BF16 EPYC, against oneDNN-packed bf16 (interleaved, medians): 3.9 vs 7.9 ms at 1
  row, 3.9 vs 5.9 at 4, 10.4 vs 11.5 at 16, 30.3 vs 33.7 at 64, 226 vs 231 at 512; both at
  75-95% of this core's measured bf16 dot-product peak (~205 GFLOP/s) for large M. AMX
  machines keep oneDNN, whose AMX kernels this GEMM cannot match: the same 30 layers, 1
  thread, 2-core Xeon with AMX (interleaved, medians): fak_gemm 22.2 vs oneDNN 9.2 ms at
  16 rows, 89 vs 15.6 at 64, 1,292 vs 100 at 1,000 (~2.1 TFLOP/s); 5.4 vs 5.9 at 1 row,
  7.2 vs 8.5 at 4, where the C GEMV below takes 1-2 rows.
- "onednn_gemm": float32 on an x86 CPU, a oneDNN-packed copy (its fp32 GEMMs beat MKL's:
  SmolLM2, 1 thread, 2-core AVX2 EPYC, cold 1,000-token TTFT 5.99 -> 5.66 s, 16 concurrent
  120-token prompts 23.1 -> 25.5 tok/s, 64: 30.0 -> 34.2).

A few rows (a decode: `few_rows`, 2) are bound by the weight bytes, which every library GEMV
here read at well under the memory's bandwidth; they run fak's C GEMV (`cpu_native.gemv`:
each weight row read once for all rows, fp32 accumulation) on the plain weight. SmolLM2's 30
layers plus its lm_head at one row, 1 thread, 2-core AVX512-BF16 EPYC: bf16 oneDNN 21.2 ms,
the C GEMV 13.4 ms; fp32 MKL's SGEMV on [in, out] copies (the earlier one-row path) 45.7 ms,
the C GEMV 27.0 ms, and bf16 built for AVX2 only 20.3 ms against aten's bf16 GEMV 48.6 ms.
Where the C kernels did not build, the earlier paths run: MKL's SGEMV on an [in, out] copy
for an "onednn_gemm" row, aten's bf16 GEMV for up to two "widened" rows, the packed weight
for "onednn". The kinds differ in summation order only (fp32 ~1e-4, bf16 one rounding).
A packed or widened model holds its weights twice (the plain copy for the few rows).
Past the few rows oneDNN's packed GEMMs run on every usable core (`on_wide_threads`), as the
C kernels do; the figures above are one thread's.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from native_engine.kernels import cpu_native
from native_engine.kernels.cpu_features import AMX_BF16

LINEAR_KINDS = ("aten", "onednn", "widened", "onednn_gemm", "fak_gemm")

# Up to this many rows a linear runs the C GEMV where it built (bf16, 1 thread, the 30
# layers' linears: 11.1 against oneDNN's 17.5 ms at 1 row, 15.5 against 25 at 2, even at 4).
NATIVE_GEMV_ROWS = 2
# Without it: a widened linear runs the bf16 GEMV up to this many rows (1 thread, 2-core AVX2
# EPYC, the 30 layers: bf16 against fp32 39 vs 70 ms at 1 row, 70 vs 111 at 2, 133 vs 124
# at 4), an onednn_gemm one MKL's SGEMV for one row (88 vs 102 ms at 1 row, 150 vs 105 at 2).
GEMV_ROWS = 2
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


def on_wide_threads(fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """`fn(*args)` with torch's ops on the C kernels' thread count (`cpu_native.WIDE_THREADS`,
    every usable core) instead of torch's (a core left free): a GEMM past a few rows is one
    long op that splits evenly. oneDNN's fp32 GEMM, [rows, 576] @ [576, 1536], 1 against 2
    threads on the 2-core AVX512-BF16 EPYC: 105 vs 87 us at 4 rows, 362 vs 212 at 16, 1,451
    vs 669 at 64, 19.5 vs 10.3 ms at 1,000. Only oneDNN's packed GEMMs run here: they gave
    the same bits on 1 and 2 threads for every shape tried (fp32 and bf16, SmolLM2's shapes,
    1-69, 128, 333, 1,000 rows; tested), MKL's sgemm behind aten did not (5-11 rows)."""
    narrow, wide = torch.get_num_threads(), cpu_native.WIDE_THREADS
    if narrow >= wide:
        return fn(*args)
    torch.set_num_threads(wide)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(narrow)


def choose_linear(dtype: torch.dtype, device: torch.device) -> str:
    """fak's packed GEMM for bf16 on AVX512-BF16 CPUs without AMX (where its kernels built),
    oneDNN-packed bf16 on other CPUs that pack it (AMX machines: measured above), widened
    bf16 on CPUs that do not (aten's bf16 GEMM there is 4-9x slower than fp32 past a few
    rows); fp32 GEMMs through oneDNN on x86 CPUs (AVX2 or AVX-512) that pack fp32; aten
    everywhere else (CUDA, other CPUs: not measured)."""
    if device.type == "cpu" and dtype == torch.bfloat16:
        kernels = cpu_native.load()
        if kernels is not None and kernels.gemm_panel_columns and not AMX_BF16:
            return "fak_gemm"
        return "onednn" if onednn_packs(dtype) else "widened"
    if (device.type == "cpu" and dtype == torch.float32
            and torch.backends.cpu.get_cpu_capability().startswith("AVX")
            and onednn_packs(dtype)):
        return "onednn_gemm"
    return "aten"


class Linear:
    """One weight [out, in] and its kernels; calling it computes x @ W.T for x [2-D, in].

    `weight` is what the kind reads past `few_rows` rows: the plain tensor for aten, the
    packed one for oneDNN, the [in, out] copy for onednn_gemm without the C GEMV
    (`transposed`), `packed`'s data for fak_gemm (every row); `wide` is a widened or
    onednn_gemm linear's float32 copy, oneDNN-packed when `packed_wide`. `native` (the C
    kernels, where they built and the kind is not aten) runs rows up to `few_rows` on
    `plain`, the weight as loaded (None for fak_gemm)."""

    __slots__ = ("few_rows", "kind", "native", "packed", "packed_wide", "plain", "transposed",
                 "weight", "wide")

    def __init__(self, weight: torch.Tensor, kind: str) -> None:
        if kind not in LINEAR_KINDS:
            raise ValueError(f"linear kind must be one of {LINEAR_KINDS}, got {kind!r}")
        if kind == "widened" and weight.dtype != torch.bfloat16:
            raise ValueError(f"a widened linear takes a bf16 weight, got {weight.dtype}")
        if kind == "onednn_gemm" and weight.dtype != torch.float32:
            raise ValueError(f"an onednn_gemm linear takes a float32 weight, got {weight.dtype}")
        self.kind = kind
        self.native = (cpu_native.load() if kind != "aten" and weight.device.type == "cpu"
                       and weight.dtype in cpu_native.SUFFIX else None)
        self.packed: cpu_native.PackedWeight | None = None
        if kind == "fak_gemm":
            if self.native is None or weight.dtype != torch.bfloat16:
                raise ValueError("a fak_gemm linear takes a bf16 CPU weight and fak's kernels")
            self.packed = cpu_native.pack_weight(self.native, weight)
            self.plain = self.wide = None
            self.weight = self.packed.data  # the plain weight is not kept
            self.transposed, self.packed_wide, self.few_rows = False, False, 0
            return
        self.plain = weight.contiguous() if self.native is not None else None
        self.transposed = (self.native is None and kind == "onednn_gemm"
                           and weight.shape[0] >= weight.shape[1])
        self.weight = (torch.ops.mkldnn._reorder_linear_weight(weight, 1) if kind == "onednn"
                       else weight.t().contiguous() if self.transposed
                       else self.plain if self.plain is not None else weight)
        wide = weight.float() if kind in ("widened", "onednn_gemm") else None
        self.packed_wide = wide is not None and (kind == "onednn_gemm"
                                                 or onednn_packs(torch.float32))
        self.wide = (torch.ops.mkldnn._reorder_linear_weight(wide)
                     if wide is not None and self.packed_wide else wide)
        self.few_rows = (NATIVE_GEMV_ROWS if self.native is not None
                         else SGEMV_ROWS if kind == "onednn_gemm" else GEMV_ROWS)

    @property
    def few_rows_kernel(self) -> str:
        """What runs a decode's few rows: the C GEMV, or the kind's own kernel."""
        return "c_gemv" if self.plain is not None else self.kind

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and self.native is not None:
            return cpu_native.gemm(self.native, x.contiguous(), self.packed)
        few = x.shape[0] <= self.few_rows
        if few and self.native is not None and self.plain is not None:
            return cpu_native.gemv(self.native, x.contiguous(), self.plain)
        if few or x.device.type != "cpu" or not (self.kind == "onednn" or self.packed_wide):
            return self._torch(x, few)
        return on_wide_threads(self._torch, x, few)

    def _torch(self, x: torch.Tensor, few: bool) -> torch.Tensor:
        if self.wide is not None and not few:
            x32 = x.float()
            out = (torch.ops.mkldnn._linear_pointwise(x32, self.wide, None, "none", [], "")
                   if self.packed_wide else F.linear(x32, self.wide))
            return out.to(x.dtype)
        if self.kind == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")
        if self.transposed:
            return torch.mm(x, self.weight)
        return F.linear(x, self.weight)
