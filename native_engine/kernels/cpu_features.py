"""What this CPU multiplies in hardware, decided once per process from its flags: bf16 at all
(AMX tiles or AVX512-BF16: `FAST_BF16`, what the dtype choice in `native_engine.model.machine`
reads) and bf16 tiles (AMX: `AMX_BF16`, what torch_fast's decode attention reads); and the
cores this process may use."""

from __future__ import annotations

import os
from pathlib import Path

import torch

# Flags that decide it (as /proc/cpuinfo spells them).
BF16_MATRIX_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16")
AMX_FLAGS = ("amx_bf16", "amx_tile")


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


def has_amx_bf16(flags: frozenset[str]) -> bool:
    """bf16 tiles (AMX): by the flags, or by torch's own probe when flags are absent."""
    if flags:
        return all(f in flags for f in AMX_FLAGS)
    return bool(torch.cpu._is_amx_tile_supported())


def usable_cores() -> tuple[int | None, int]:
    """(`OMP_NUM_THREADS` where set to a positive whole number, else None; the cores this
    process may run on)."""
    explicit = os.environ.get("OMP_NUM_THREADS", "")
    threads = int(explicit) if explicit.isdigit() and int(explicit) > 0 else None
    return threads, len(os.sched_getaffinity(0))


CPU_FLAGS = cpu_flags()  # read once per process
FAST_BF16 = has_fast_bf16(CPU_FLAGS)
AMX_BF16 = has_amx_bf16(CPU_FLAGS)
