"""What this machine computes fastest, decided once at start-up from its CPU flags.

The dtype follows the matrix units: bf16 where the CPU multiplies bf16 natively (AMX tiles
or AVX512-BF16; oneDNN then runs the linears), float32 elsewhere. Measured on the 2-core
AVX2 EPYC (no AMX, no AVX512-BF16): the 30 layers' linears of SmolLM2 at 64 rows took
2,140 ms in bf16 against 239 ms in fp32, and 26 against 44 ms at one row (1 thread), so an
AVX2 machine gets float32. `--dtype bfloat16` there runs widened linears
(`native_engine.kernels.linear`; batch-1 decode about 1.5x fp32's, `bench/native_speed.py`)
but stays opt-in: its greedy output is bf16's, and at a near-tie it follows the kernel, not
the prompt — the README's question ("What is the capital of France?", fp32 margin 0.08
between "The" and "L" at logit 25.3, where bf16 logits are 0.125 apart) answered "The…"
after a whole prefill (fp32 SGEMM) and "L'Étoile…" after a cached one (one row, bf16
GEMV). CUDA gets bf16 and the Triton kernels. The choice is printed (`describe`) and
exported as an info gauge on `/metrics` (`labels`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from native_engine.kernels.cpu_features import (
    BF16_MATRIX_FLAGS,
    FAST_BF16,
    has_fast_bf16,
    usable_cores,
)

REPORTED_FLAGS = (*BF16_MATRIX_FLAGS, "avx512f", "avx2", "fma", "f16c")


def default_num_threads() -> int:
    """`OMP_NUM_THREADS` where it is set (as torch and vLLM read it), else one core fewer
    than this process may use (at least one).

    Torch's OpenMP threads spin-wait on each other; when another busy thread (the server's
    event loop, a neighbour process) takes a core, a 2-thread decode step on 2 cores ran
    ~16x slower than a 1-thread one in our measurement, so a core is left free.
    """
    explicit, cores = usable_cores()
    return explicit or max(1, cores - 1)


@dataclass(frozen=True)
class ComputeChoice:
    """The dtype, kernels and threads a runner uses, and the CPU facts they follow from."""

    device: str
    dtype: str
    attention: str
    decode_attention_dtype: str
    linear: str
    num_threads: int
    cpu_capability: str
    flags: tuple[str, ...]
    few_rows_linear: str  # what runs a decode's few-row linears: "c_gemv" or `linear`
    wide_threads: int  # threads of the C kernels' GEMMs and attentions

    def describe(self) -> str:
        return (f"compute: device={self.device} dtype={self.dtype} attention={self.attention} "
                f"decode_attention_dtype={self.decode_attention_dtype} linear={self.linear} "
                f"few_rows_linear={self.few_rows_linear} threads={self.num_threads} "
                f"wide_threads={self.wide_threads} "
                f"cpu_capability={self.cpu_capability} flags={','.join(self.flags) or '-'}")

    def labels(self) -> dict[str, str]:
        return {"device": self.device, "dtype": self.dtype, "attention": self.attention,
                "decode_attention_dtype": self.decode_attention_dtype, "linear": self.linear,
                "few_rows_linear": self.few_rows_linear, "wide_threads": str(self.wide_threads),
                "threads": str(self.num_threads),
                "cpu_capability": self.cpu_capability, "cpu_flags": ",".join(self.flags)}


def auto_dtype(device: torch.device, flags: frozenset[str] | None = None) -> torch.dtype:
    """bfloat16 on CUDA and on CPUs with bf16 matrix units (this one's: `FAST_BF16`), float32
    otherwise."""
    if device.type == "cuda":
        return torch.bfloat16
    fast = FAST_BF16 if flags is None else has_fast_bf16(flags)
    return torch.bfloat16 if fast else torch.float32


def reported_flags(flags: frozenset[str]) -> tuple[str, ...]:
    return tuple(f for f in REPORTED_FLAGS if f in flags)
