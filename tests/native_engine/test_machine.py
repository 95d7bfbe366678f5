"""The start-up choice of dtype and kernels follows the CPU's flags."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from native_engine.kernels import cpu_native, torch_fast
from native_engine.kernels.cpu_features import (
    AMX_BF16,
    FAST_BF16,
    cpu_flags,
    has_amx_bf16,
    has_fast_bf16,
)
from native_engine.model.machine import (
    ComputeChoice,
    auto_dtype,
    default_num_threads,
    reported_flags,
)
from native_engine.model.runner import ModelRunner, RunnerConfig
from tests.native_engine.tiny_model import random_model

AVX2 = frozenset({"fpu", "sse2", "avx", "avx2", "fma", "f16c"})
SAPPHIRE = AVX2 | {"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}


def test_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2 fma\n\n"
                    "processor\t: 1\nflags\t\t: fpu avx2 fma\n")
    assert cpu_flags(info) == {"fpu", "avx2", "fma"}
    assert cpu_flags(tmp_path / "absent") == frozenset()


def test_bf16_only_with_matrix_units() -> None:
    assert not has_fast_bf16(AVX2)
    assert has_fast_bf16(SAPPHIRE)
    assert has_fast_bf16(AVX2 | {"avx512_bf16"})
    cpu = torch.device("cpu")
    assert auto_dtype(cpu, AVX2) == torch.float32
    assert auto_dtype(cpu, SAPPHIRE) == torch.bfloat16
    assert auto_dtype(torch.device("cuda"), AVX2) == torch.bfloat16
    assert reported_flags(SAPPHIRE) == ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f",
                                        "avx2", "fma", "f16c")


def test_the_dtype_and_the_decode_attention_follow_the_flags() -> None:
    """bf16 by default where the CPU multiplies bf16; torch_fast's decodes attend in bf16
    only where it has AMX tiles (SDPA's bf16 decode was slower than fp32 on AVX512-BF16)."""
    cpu = torch.device("cpu")
    assert has_fast_bf16(cpu_flags()) == FAST_BF16 and has_amx_bf16(cpu_flags()) == AMX_BF16
    assert (auto_dtype(cpu) == torch.bfloat16) == FAST_BF16
    assert (not AMX_BF16) == torch_fast.DECODE_UPCAST
    want = torch.bfloat16 if AMX_BF16 else torch.float32
    assert torch_fast.decode_dtype(torch.bfloat16, cpu) == want
    assert has_amx_bf16(SAPPHIRE) and not has_amx_bf16(AVX2 | {"avx512_bf16"})


def test_runner_reports_its_choice_for_this_machine() -> None:
    runner = ModelRunner(RunnerConfig(num_blocks=8, block_size=4, num_threads=1),
                         random_model())
    choice = runner.compute
    assert isinstance(choice, ComputeChoice)
    want = torch.bfloat16 if has_fast_bf16(cpu_flags()) else torch.float32
    assert runner.dtype == want and choice.dtype == str(want).removeprefix("torch.")
    assert choice.attention == "cpu_backend" and choice.num_threads == 1
    assert choice.decode_attention_dtype == "float32"
    assert choice.few_rows_linear == ("fak_gemm" if choice.linear == "fak_gemm" else "c_gemv")
    assert choice.wide_threads == cpu_native.WIDE_THREADS
    assert choice.cpu_capability == torch.backends.cpu.get_cpu_capability()
    assert set(choice.flags) <= cpu_flags()
    line = choice.describe()
    assert f"dtype={choice.dtype}" in line and f"linear={choice.linear}" in line
    assert f"decode_attention_dtype={choice.decode_attention_dtype}" in line
    assert choice.labels()["cpu_flags"] == ",".join(choice.flags)


def test_threads_follow_omp_num_threads_else_leave_a_core(monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert default_num_threads() == 3
    for unset in ("", "0", "two"):
        monkeypatch.setenv("OMP_NUM_THREADS", unset)
        assert default_num_threads() == max(1, len(os.sched_getaffinity(0)) - 1)
