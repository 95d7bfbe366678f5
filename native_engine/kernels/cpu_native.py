"""fak's C kernels for the CPU (`csrc/cpu_kernels.c`): built once per machine, called via ctypes.

Torch has no fast kernel for the two shapes a CPU decode step is made of. A decode's
attention is one query row per request over its own paged context: SDPA's CPU kernels run
it as hundreds of tiny problems (bf16, 64 requests of 160 tokens, SmolLM2 heads, 1 thread,
the 2-core AVX512-BF16 EPYC: 18.3 ms a layer, fp32 upcast 24.6 ms, against 4.4 ms here, which
reads the blocks where they lie instead of gathering them). A few-row linear is bound by the
weight bytes, which oneDNN's and MKL's GEMVs read at well under the memory's bandwidth.

The library is compiled by the machine's C compiler for the machine itself
(`-O3 -march=native -fopenmp`) into a cache keyed by the source, the command and the CPU
flags (`$FAK_KERNEL_CACHE`, else `$XDG_CACHE_HOME/fak/kernels`, else `~/.cache/fak/kernels`),
so a second start loads it in milliseconds and another machine builds its own. Where no
compiler, build or load works, `load()` says why in one log line and returns None; the
callers then keep torch's kernels (an unknown capability is off). `FAK_CPU_KERNELS=0` turns
the library off (for A/B runs against torch's kernels).

The wrappers check every shape, dtype, contiguity and block id before a call: the C side
trusts its arguments.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from native_engine.kernels.cpu_features import CPU_FLAGS, usable_cores

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.c"
ABI = 1
COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
BUILD_TIMEOUT_S = 120.0
MAX_HEAD_DIM, MAX_GROUP = 512, 16  # as csrc/cpu_kernels.c
SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
log = logging.getLogger(__name__)

_P, _I, _F, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "decode_attention": [_P, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _I, _F, _P, _P, _INT],
    "gemv": [_P, _P, _I, _I, _I, _P, _INT],
    "add_rms_norm": [_P, _P, _P, _P, _I, _I, _F, _INT],
    "silu_mul": [_P, _P, _I, _I, _INT],
    "rope": [_P, _P, _P, _P, _I, _I, _I, _I, _INT],
    "argmax": [_P, _I, _I, _P, _INT],
    "prefill_attention": [_P, _I, _P, _P, _P, _I, _I, _I, _I, _I, _I, _F, _P, _INT],
}
_GEMM_SIGNATURES = {"gemm_pack": [_P, _I, _I, _P], "gemm": [_P, _I, _I, _P, _I, _P, _INT]}
_RESTYPES = {"gemv": ctypes.c_int, "prefill_attention": ctypes.c_int}


def cache_dir() -> Path:
    explicit = os.environ.get("FAK_KERNEL_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fak" / "kernels"


def build(compiler: str, source: Path = SOURCE, directory: Path | None = None,
          flags: tuple[str, ...] = COMPILE_FLAGS) -> Path:
    """The library for this machine, compiled unless the cache has it; raises RuntimeError
    with the compiler's words when it cannot be built. (Other `flags` build it for another
    instruction set, as the tests do for the AVX2 and scalar paths.)"""
    command = [compiler, *flags]
    key = hashlib.sha256(source.read_bytes() + "\0".join(command).encode()
                         + ",".join(sorted(CPU_FLAGS)).encode()).hexdigest()[:20]
    directory = directory or cache_dir()
    target = directory / f"fak-cpu-kernels-{key}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    # Concurrent builders (several engines starting at once) each write their own file;
    # the rename is atomic, so a reader sees a whole library or none.
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".so.tmp")
    os.close(fd)
    try:
        done = subprocess.run([*command, "-o", tmp, str(source), "-lm"], capture_output=True,
                              text=True, timeout=BUILD_TIMEOUT_S, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-400:]}")
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return target


@dataclass(frozen=True)
class CpuKernels:
    """The loaded library's entry points by dtype; `gemm_panel_columns` is the packed bf16
    GEMM's panel width, 0 where it was not built (no AVX512-BF16)."""

    path: Path
    functions: dict[str, Callable[..., Any]]
    gemm_panel_columns: int = 0

    def fn(self, name: str, dtype: torch.dtype) -> Callable[..., Any]:
        return self.functions[f"{name}_{SUFFIX[dtype]}"]


def open_library(path: Path) -> CpuKernels:
    lib = ctypes.CDLL(str(path))
    lib.fak_kernels_abi.restype = ctypes.c_int
    if lib.fak_kernels_abi() != ABI:
        raise RuntimeError(f"{path} has ABI {lib.fak_kernels_abi()}, expected {ABI}")
    functions = {}
    for name, argtypes in _SIGNATURES.items():
        for suffix in SUFFIX.values():
            fn = getattr(lib, f"fak_{name}_{suffix}")
            fn.argtypes, fn.restype = argtypes, _RESTYPES.get(name)
            functions[f"{name}_{suffix}"] = fn
    lib.fak_gemm_panel_columns.restype = ctypes.c_int
    panel_columns = lib.fak_gemm_panel_columns()
    if panel_columns:  # built with AVX512-BF16: the packed bf16 GEMM
        for name, argtypes in _GEMM_SIGNATURES.items():
            fn = getattr(lib, f"fak_{name}_bf16")
            fn.argtypes, fn.restype = argtypes, None
            functions[f"{name}_bf16"] = fn
    return CpuKernels(path, functions, panel_columns)


def find_compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


@functools.cache
def load() -> CpuKernels | None:
    """The kernels for this machine, or None (the reason logged once)."""
    if os.environ.get("FAK_CPU_KERNELS", "1") == "0":
        log.info("cpu kernels: off (FAK_CPU_KERNELS=0)")
        return None
    compiler = find_compiler()
    if compiler is None:
        log.warning("cpu kernels: off, no C compiler (gcc or $CC) on PATH; torch's kernels run")
        return None
    try:
        kernels = open_library(build(compiler))
    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as exc:
        log.warning("cpu kernels: off, %s; torch's kernels run", exc)
        return None
    log.info("cpu kernels: %s", kernels.path)
    return kernels


def _wide_threads() -> int:
    """The C kernels' threads: `OMP_NUM_THREADS` where set, else every core this process may
    use. The GEMMs, GEMVs and attentions always take them, the row-parallel kernels from
    `ELEMENTWISE_WIDE_ROWS` rows, oneDNN's GEMMs through `linear.on_wide_threads`; torch's
    other ops keep torch's count (a core left free, `model.machine.default_num_threads`): a
    step of many short torch ops stalls when one of its threads loses its core, while these
    kernels hand a slow thread's share to the others (dynamic schedules).

    Measured on the 2-core AVX512-BF16 EPYC, each pair side by side in one run: GEMMs and
    attentions on both cores against only from 128 rows, through `fak engine serve` (random
    120 in / 32 out): 43.3 -> 50.6 tok/s at 1 request, 159 -> 179 at 16, 159 -> 173 at 64;
    a cold 1,000-token prefill in process 1.60 -> 0.91 s. The GEMV at one row (SmolLM2's 30
    layers and lm_head), 1 against 2 threads: fp32 31.9 vs 20.8 ms, bf16 13.3 vs 10.3 ms."""
    explicit, cores = usable_cores()
    return explicit or cores


WIDE_THREADS = _wide_threads()
# The row-parallel elementwise kernels and argmax take the wide threads from this many rows;
# below it a thread team costs more than it saves (bf16, 2-core AVX512-BF16 EPYC, 1 against
# 2 threads: RMSNorm 2.2 vs 2.6 us at 1 row, 3.0 vs 3.5 at 4, 16.6 vs 11.1 at 64; SiLU·up
# 2.4 vs 2.9, 4.6 vs 3.5, 52.7 vs 30.1; at 1,000 rows 223 vs 128 and 878 vs 421).
ELEMENTWISE_WIDE_ROWS = 8


def row_threads(rows: int) -> int:
    return WIDE_THREADS if rows >= ELEMENTWISE_WIDE_ROWS else 1


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(f"cpu kernel argument: {what}")


@dataclass(frozen=True)
class DecodeTables:
    """One step's decodes, checked once for every layer: request r's positions p < ctx[r]
    lie in block tables[r, p // block_size], each block id below num_blocks."""

    tables: torch.Tensor  # int64 [R, W], contiguous
    ctx: torch.Tensor  # int64 [R], contiguous, each in [1, W * block_size]
    longest: int
    num_blocks: int
    block_size: int

    @classmethod
    def checked(cls, tables: torch.Tensor, ctx: torch.Tensor, num_blocks: int,
                block_size: int) -> DecodeTables:
        tables, ctx = tables.contiguous(), ctx.contiguous()
        _check(tables.dtype == ctx.dtype == torch.int64, "int64 tables and lengths")
        _check(tables.dim() == 2 and ctx.shape == (tables.shape[0],) and tables.shape[0] > 0,
               "table and length shapes")
        longest = int(ctx.max())
        _check(int(ctx.min()) >= 1 and longest <= tables.shape[1] * block_size,
               "context lengths")
        used = tables[:, : -(-longest // block_size)]
        _check(int(used.min()) >= 0 and int(used.max()) < num_blocks, "block ids")
        return cls(tables, ctx, longest, num_blocks, block_size)


def decode_attention(kernels: CpuKernels, q: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, decodes: DecodeTables, scale: float) -> torch.Tensor:
    """One query row per request over its paged context: q [R, Hq, D] → [R, Hq, D].

    k_cache, v_cache [NB, BS, Hkv, D] in q's dtype, of the shape `decodes` was checked for.
    Scores, softmax and the weighted sum are float32, each request on its own.
    """
    num_reqs, hq, d = q.shape
    nb, bs, hkv, _ = k_cache.shape
    dtype = q.dtype
    _check(dtype in SUFFIX and k_cache.dtype == v_cache.dtype == dtype, "dtypes")
    _check(q.device.type == k_cache.device.type == v_cache.device.type == "cpu", "cpu tensors")
    _check(k_cache.shape == v_cache.shape and k_cache.shape[3] == d
           and (nb, bs) == (decodes.num_blocks, decodes.block_size), "cache shapes")
    _check(num_reqs == decodes.tables.shape[0], "one query row per request")
    _check(hq % hkv == 0 and hq // hkv <= MAX_GROUP and d <= MAX_HEAD_DIM, "head layout")
    _check(q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous(),
           "contiguous q and caches")
    scratch = torch.empty(num_reqs, hq, decodes.longest, dtype=torch.float32)
    out = torch.empty_like(q)
    tables = decodes.tables
    kernels.fn("decode_attention", dtype)(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
        tables.shape[1], decodes.ctx.data_ptr(), num_reqs, hq, hkv, d, bs, decodes.longest,
        scale, scratch.data_ptr(), out.data_ptr(), WIDE_THREADS)
    return out


def gemv(kernels: CpuKernels, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, in] @ weight [out, in].T in weight's dtype (meant for a few rows M)."""
    rows, width = x.shape
    dtype = weight.dtype
    _check(dtype in SUFFIX and x.dtype == dtype, "dtypes")
    _check(weight.dim() == 2 and weight.shape[1] == width, "shapes")
    _check(x.is_contiguous() and weight.is_contiguous(), "contiguous")
    _check(x.device.type == weight.device.type == "cpu", "cpu tensors")
    out = torch.empty(rows, weight.shape[0], dtype=dtype)
    if rows == 0:
        return out
    status = kernels.fn("gemv", dtype)(x.data_ptr(), weight.data_ptr(), rows, width,
                                       weight.shape[0], out.data_ptr(), WIDE_THREADS)
    if status != 0:
        raise MemoryError("cpu kernel gemv: no memory for the widened rows")
    return out


def _rows(x: torch.Tensor, width: int, what: str) -> int:
    _check(x.dtype in SUFFIX and x.device.type == "cpu" and x.is_contiguous()
           and x.dim() == 2 and x.shape[1] == width, what)
    return int(x.shape[0])


def add_rms_norm(kernels: CpuKernels, h: torch.Tensor, delta: torch.Tensor | None,
                 weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`h += delta` in place (rounded to h's dtype; none when delta is None), then RMSNorm of
    h scaled by `weight` [n], computed in float32 and rounded once. h [rows, n]."""
    n = weight.shape[0]
    rows = _rows(h, n, "h [rows, n] contiguous")
    _check(weight.dtype == h.dtype and weight.is_contiguous() and weight.dim() == 1, "weight")
    if delta is not None:
        _check(_rows(delta, n, "delta [rows, n] contiguous") == rows
               and delta.dtype == h.dtype, "delta")
    out = torch.empty_like(h)
    kernels.fn("add_rms_norm", h.dtype)(
        h.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(),
        out.data_ptr(), rows, n, eps, row_threads(rows))
    return out


def silu_mul(kernels: CpuKernels, gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [rows, 2n] = [gate | up], in float32, rounded once."""
    _check(gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0, "gate_up [rows, 2n]")
    rows = _rows(gate_up, gate_up.shape[1], "gate_up contiguous")
    n = gate_up.shape[1] // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype)
    kernels.fn("silu_mul", gate_up.dtype)(gate_up.data_ptr(), out.data_ptr(), rows, n,
                                          row_threads(rows))
    return out


@dataclass(frozen=True)
class Positions:
    """One step's token positions, checked once for every layer: int64 [T], each a row of
    RoPE tables of `table_rows` rows."""

    positions: torch.Tensor
    table_rows: int

    @classmethod
    def checked(cls, positions: torch.Tensor, table_rows: int) -> Positions:
        positions = positions.contiguous()
        _check(positions.dtype == torch.int64 and positions.dim() == 1, "int64 positions")
        _check(positions.numel() == 0 or (int(positions.min()) >= 0
                                          and int(positions.max()) < table_rows), "positions")
        return cls(positions, table_rows)


def rope_(kernels: CpuKernels, x: torch.Tensor, positions: Positions, cos: torch.Tensor,
          sin: torch.Tensor) -> None:
    """Rotate-half RoPE in place on x [T, H, D] (each token's H heads contiguous; rows may be
    strided, as q and k heads inside a fused qkv output), with float32 tables cos, sin
    [positions.table_rows, D / 2], computed in float32 and rounded once."""
    tokens, heads, d = x.shape
    _check(x.dtype in SUFFIX and x.device.type == "cpu" and d % 2 == 0
           and x.stride(2) == 1 and x.stride(1) == d, "x [T, H, D], heads contiguous")
    _check(positions.positions.shape == (tokens,), "one position per token")
    _check(cos.dtype == sin.dtype == torch.float32
           and cos.shape == sin.shape == (positions.table_rows, d // 2)
           and cos.is_contiguous() and sin.is_contiguous(), "tables")
    if tokens:
        kernels.fn("rope", x.dtype)(x.data_ptr(), positions.positions.data_ptr(),
                                    cos.data_ptr(), sin.data_ptr(), tokens, heads, d,
                                    x.stride(0), row_threads(tokens))


def argmax(kernels: CpuKernels, x: torch.Tensor) -> torch.Tensor:
    """Per row of x [rows, n] (n >= 1) the first index of its largest value, as int64; -1 for
    a row holding a NaN or an infinity."""
    rows = _rows(x, x.shape[1] if x.dim() == 2 else -1, "x [rows, n] contiguous")
    _check(x.shape[1] >= 1, "n >= 1")
    index = torch.empty(rows, dtype=torch.int64)
    kernels.fn("argmax", x.dtype)(x.data_ptr(), rows, x.shape[1], index.data_ptr(),
                                  row_threads(rows))
    return index


def prefill_attention(kernels: CpuKernels, q: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, blocks: torch.Tensor, ctx: int,
                      scale: float) -> torch.Tensor:
    """A chunk of one request: q [n, Hq, D] are its context's last n positions, each
    attending causally to the first `ctx` positions of K, V, which the caches [NB, BS, Hkv,
    D] already hold at int64 `blocks` (block p // BS of position p). q's heads must be
    contiguous per token (its tokens may be strided, as inside a fused qkv output). Float32
    scores, softmax and weighted values; out [n, Hq, D] in q's dtype."""
    n, hq, d = q.shape
    nb, bs, hkv, _ = k_cache.shape
    dtype = q.dtype
    _check(dtype in SUFFIX and k_cache.dtype == v_cache.dtype == dtype, "dtypes")
    _check(q.device.type == k_cache.device.type == v_cache.device.type == "cpu", "cpu tensors")
    _check(k_cache.shape == v_cache.shape and k_cache.shape[3] == d, "cache shapes")
    _check(k_cache.is_contiguous() and v_cache.is_contiguous(), "contiguous caches")
    _check(q.stride(2) == 1 and q.stride(1) == d, "q's heads contiguous per token")
    _check(hq % hkv == 0 and hq // hkv <= MAX_GROUP and d <= MAX_HEAD_DIM, "head layout")
    _check(1 <= n <= ctx and blocks.dtype == torch.int64 and blocks.dim() == 1
           and blocks.is_contiguous() and blocks.shape[0] * bs >= ctx, "lengths and blocks")
    used = blocks[: -(-ctx // bs)]
    _check(int(used.min()) >= 0 and int(used.max()) < nb, "block ids")
    out = torch.empty(n, hq, d, dtype=dtype)
    status = kernels.fn("prefill_attention", dtype)(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), blocks.data_ptr(),
        n, ctx, hq, hkv, d, bs, scale, out.data_ptr(), WIDE_THREADS)
    if status != 0:
        raise MemoryError("cpu kernel prefill_attention: no memory for its widened K, V")
    return out


@dataclass(frozen=True)
class PackedWeight:
    """A bf16 weight [n, k] packed for `gemm`: panels of the kernels' `gemm_panel_columns`
    output columns, each [ceil(k / 2)][columns] pairs of adjacent-k values, zero-padded."""

    data: torch.Tensor  # int32, the packed pairs
    n: int
    k: int


def pack_weight(kernels: CpuKernels, weight: torch.Tensor) -> PackedWeight:
    """Pack a bf16 weight [n, k] once for `gemm` (needs `kernels.gemm_panel_columns`)."""
    columns = kernels.gemm_panel_columns
    _check(columns > 0, "the packed GEMM needs AVX512-BF16")
    _check(weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.device.type == "cpu",
           "a bf16 weight [n, k] on the CPU")
    weight = weight.contiguous()
    n, k = weight.shape
    panels = -(-n // columns)
    data = torch.empty(panels * -(-k // 2) * columns, dtype=torch.int32)
    kernels.fn("gemm_pack", torch.bfloat16)(weight.data_ptr(), n, k, data.data_ptr())
    return PackedWeight(data, n, k)


def gemm(kernels: CpuKernels, x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    """x [M, k] bf16 @ the packed weight's [n, k].T → [M, n] bf16 (float32 accumulation,
    rounded once), any M >= 0."""
    rows = _rows(x, weight.k, "x [M, k] contiguous")
    _check(x.dtype == torch.bfloat16, "bf16 x")
    out = torch.empty(rows, weight.n, dtype=torch.bfloat16)
    if rows:
        kernels.fn("gemm", torch.bfloat16)(x.data_ptr(), rows, weight.k, weight.data.data_ptr(),
                                           weight.n, out.data_ptr(), WIDE_THREADS)
    return out
