"""Whether this CPU multiplies bf16 in hardware (AMX tiles or AVX512-BF16), decided once
per process: the dtype choice (`native_engine.model.machine`) and the decode attention
(`torch_fast`) read this one fact, so they cannot disagree."""

from __future__ import annotations

from pathlib import Path

import torch

# Flags that decide it (as /proc/cpuinfo spells them).
BF16_MATRIX_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first processor's flags; empty where /proc/cpuinfo is absent (not Linux)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def has_fast_bf16(flags: frozenset[str]) -> bool:
    """bf16 matmuls in hardware: by the flags, or by torch's own probe when flags are absent."""
    if flags:
        return any(f in flags for f in BF16_MATRIX_FLAGS)
    return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())


CPU_FLAGS = cpu_flags()  # read once per process
FAST_BF16 = has_fast_bf16(CPU_FLAGS)
