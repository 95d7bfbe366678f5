"""fak's C kernels (cpu_native) and the cpu backend, against the torch_ref oracle and torch.

The library is tested as this machine builds it (`-march=native`: AVX-512 here) and also
built for AVX2 alone and for no vector unit, so the paths another machine takes are
checked here too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from native_engine.kernels import cpu_backend, cpu_native, torch_ref
from native_engine.kernels.paged_batch import make_paged_batch

HEADS = st.sampled_from([(1, 1), (4, 2), (9, 3), (8, 1), (16, 2)])
DTYPES = st.sampled_from([torch.float32, torch.bfloat16])
BASE_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
VARIANT_FLAGS = {"avx2": ("-mavx2", "-mfma"), "scalar": ()}


def native() -> cpu_native.CpuKernels:
    loaded = cpu_native.load()
    assert loaded is not None, "fak's C kernels did not build on this machine"
    return loaded


@pytest.fixture(scope="module", params=["native", "avx2", "scalar"])
def variant(request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> cpu_native.CpuKernels:
    if request.param == "native":
        return native()
    compiler = cpu_native.find_compiler()
    assert compiler is not None
    path = cpu_native.build(compiler, directory=tmp_path_factory.mktemp(request.param),
                            flags=BASE_FLAGS + VARIANT_FLAGS[request.param])
    return cpu_native.open_library(path)


def tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 2e-2


@settings(max_examples=80, deadline=None)
@given(
    shape=st.lists(st.tuples(st.integers(0, 24), st.integers(0, 70)), min_size=1, max_size=6),
    heads=HEADS,
    head_dim=st.sampled_from([8, 40, 64, 128]),
    page=st.sampled_from([1, 4, 16, 32]),
    dtype=DTYPES,
    seed=st.integers(0, 2**16),
)
def test_the_cpu_backend_matches_the_reference(shape, heads, head_dim, page, dtype, seed) -> None:
    """Decodes, chunks after a cached prefix, full prefills and idle requests mixed; head
    sizes that are and are not whole vector lanes; unowned slots hold NaN."""
    ctx_lens = [max(1, cached + new) for new, cached in shape]
    new_lens = [min(new, ctx) for (new, _), ctx in zip(shape, ctx_lens, strict=True)]
    batch = make_paged_batch(new_lens, ctx_lens, num_q_heads=heads[0], num_kv_heads=heads[1],
                             head_dim=head_dim, page_size=page, dtype=dtype, seed=seed)
    out = cpu_backend.paged_attention(*batch.attention_args())
    ref = torch_ref.paged_attention(*batch.attention_args())
    assert out.dtype == dtype and not out.isnan().any(), "read an unowned (poisoned) slot"
    tol = tolerance(dtype)
    torch.testing.assert_close(out.double(), ref.double(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [8, 64, 72, 128])
def test_every_build_attends_as_the_reference(variant: cpu_native.CpuKernels,
                                              dtype: torch.dtype, head_dim: int) -> None:
    ctx_lens = [1, 5, 33, 130, 64, 2]
    batch = make_paged_batch([1] * len(ctx_lens), ctx_lens, num_q_heads=9, num_kv_heads=3,
                             head_dim=head_dim, page_size=16, dtype=dtype, seed=head_dim)
    decodes = cpu_native.DecodeTables.checked(batch.block_tables.long(),
                                              batch.context_lens.long(),
                                              batch.k_cache.shape[0], 16)
    out = cpu_native.decode_attention(variant, batch.q, batch.k_cache, batch.v_cache, decodes,
                                      batch.scale)
    ref = torch_ref.paged_attention(*batch.attention_args())
    assert not out.isnan().any()
    tol = tolerance(dtype)
    torch.testing.assert_close(out.double(), ref.double(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_does_not_depend_on_its_batch(dtype: torch.dtype) -> None:
    """Each request is computed on its own: alone or beside others, the same bits."""
    ctx_lens = [37, 5, 130, 64, 1]
    batch = make_paged_batch([1] * len(ctx_lens), ctx_lens, num_q_heads=9, num_kv_heads=3,
                             head_dim=64, page_size=16, dtype=dtype, seed=7)
    together = cpu_backend.paged_attention(*batch.attention_args())
    for r in range(len(ctx_lens)):
        alone = cpu_backend.paged_attention(
            batch.q[r : r + 1], batch.k_cache, batch.v_cache, batch.block_tables[r : r + 1],
            torch.tensor([0, 1], dtype=torch.int32), batch.context_lens[r : r + 1],
            batch.scale)
        assert torch.equal(alone[0], together[r])


def test_block_ids_and_lengths_are_checked_before_the_kernel_runs() -> None:
    tables = torch.tensor([[0, 1], [2, 3]])
    ok = cpu_native.DecodeTables.checked(tables, torch.tensor([5, 8]), num_blocks=4,
                                         block_size=4)
    assert ok.longest == 8
    # Only the blocks a context reaches are read, so only they are checked.
    cpu_native.DecodeTables.checked(torch.tensor([[0, 99]]), torch.tensor([4]), 4, 4)
    bad = [
        (torch.tensor([[0, 4]]), torch.tensor([5]), "block ids"),
        (torch.tensor([[0, -1]]), torch.tensor([5]), "block ids"),
        (torch.tensor([[0, 1]]), torch.tensor([9]), "context lengths"),
        (torch.tensor([[0, 1]]), torch.tensor([0]), "context lengths"),
        (torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([5]), "int64"),
        (torch.tensor([[0, 1]]), torch.tensor([5, 5]), "shapes"),
    ]
    for tables, ctx, what in bad:
        with pytest.raises(ValueError, match=what):
            cpu_native.DecodeTables.checked(tables, ctx, num_blocks=4, block_size=4)
    batch = make_paged_batch([1], [5], num_q_heads=2, num_kv_heads=1, head_dim=8, page_size=4)
    checked = cpu_native.DecodeTables.checked(batch.block_tables.long(),
                                              batch.context_lens.long(), 99, 4)
    with pytest.raises(ValueError, match="cache shapes"):  # planned for another pool
        cpu_native.decode_attention(native(), batch.q, batch.k_cache, batch.v_cache,
                                    checked, batch.scale)
    with pytest.raises(ValueError, match="num_blocks"):
        cpu_backend.plan(None, batch.block_tables, batch.query_start_loc,
                         batch.context_lens, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "width", "out"), [(1, 576, 960), (2, 1536, 576), (3, 33, 7),
                                                    (4, 64, 5), (1, 8, 1), (8, 100, 13),
                                                    (0, 64, 5)])
def test_gemv_matches_torch(variant: cpu_native.CpuKernels, dtype: torch.dtype, rows: int,
                            width: int, out: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + width)
    x = torch.randn(rows, width, generator=gen).to(dtype)
    weight = (torch.randn(out, width, generator=gen) * 0.05).to(dtype)
    got = cpu_native.gemv(variant, x, weight)
    want = F.linear(x.double(), weight.double())
    assert got.dtype == dtype and got.shape == (rows, out)
    torch.testing.assert_close(got.double(), want, atol=tolerance(dtype), rtol=tolerance(dtype))


def test_gemv_refuses_what_it_cannot_read() -> None:
    x, weight = torch.ones(2, 8), torch.ones(3, 8)
    with pytest.raises(ValueError, match="dtypes"):
        cpu_native.gemv(native(), x.double(), weight)
    with pytest.raises(ValueError, match="contiguous"):
        cpu_native.gemv(native(), torch.ones(2, 16)[:, ::2], weight)
    with pytest.raises(ValueError, match="shapes"):
        cpu_native.gemv(native(), torch.ones(2, 9), weight)


def test_the_library_is_built_once_per_source_and_machine(tmp_path: Path) -> None:
    compiler = cpu_native.find_compiler()
    assert compiler is not None
    first = cpu_native.build(compiler, directory=tmp_path)
    built = first.stat().st_mtime_ns
    assert cpu_native.build(compiler, directory=tmp_path) == first
    assert first.stat().st_mtime_ns == built  # not compiled again
    assert cpu_native.open_library(first).path == first
    other = tmp_path / "other.c"
    other.write_text(cpu_native.SOURCE.read_text() + "\n/* another source */\n")
    assert cpu_native.build(compiler, source=other, directory=tmp_path) != first
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    with pytest.raises(RuntimeError, match="failed"):
        cpu_native.build(compiler, source=broken, directory=tmp_path)
    assert not list(tmp_path.glob("*.tmp"))


def test_without_a_compiler_torch_runs_and_says_why(tmp_path: Path) -> None:
    """No compiler: one log line, and auto is torch_fast (an unknown capability is off)."""
    code = ("import logging; logging.basicConfig(level=logging.INFO)\n"
            "from native_engine.kernels import select_backend\n"
            "print(select_backend('auto', 'cpu').__name__)\n")
    root = Path(__file__).resolve().parents[2]
    env = {"PATH": str(tmp_path), "CC": str(tmp_path / "no-such-cc"),
           "FAK_KERNEL_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, check=True, cwd=root)
    assert done.stdout.strip() == "native_engine.kernels.torch_fast"
    assert "cpu kernels: off" in done.stderr and "torch's kernels run" in done.stderr


def rounded_once(dtype: torch.dtype) -> float:
    """The tolerance of a float32 result rounded once to `dtype`, against a float64 one."""
    return 1e-5 if dtype == torch.float32 else 2 ** -8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "n"), [(1, 576), (5, 64), (3, 37), (0, 16)])
def test_add_rms_norm_matches_torch(variant: cpu_native.CpuKernels, dtype: torch.dtype,
                                    rows: int, n: int) -> None:
    gen = torch.Generator().manual_seed(rows + n)
    h = torch.randn(rows, n, generator=gen).to(dtype)
    delta = torch.randn(rows, n, generator=gen).to(dtype)
    weight = torch.randn(n, generator=gen).to(dtype)
    summed = h + delta  # rounded to dtype, as the residual stream is
    out = cpu_native.add_rms_norm(variant, h, delta, weight, 1e-5)
    assert torch.equal(h, summed)  # added in place
    want = F.rms_norm(summed.double(), (n,), weight.double(), 1e-5)
    tol = rounded_once(dtype)
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    alone = cpu_native.add_rms_norm(variant, h, None, weight, 1e-5)
    assert torch.equal(alone, out) and torch.equal(h, summed)  # no delta: h untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "n"), [(1, 1536), (4, 40), (2, 7)])
def test_silu_mul_matches_torch(variant: cpu_native.CpuKernels, dtype: torch.dtype,
                                rows: int, n: int) -> None:
    gen = torch.Generator().manual_seed(rows * n)
    gate_up = (torch.randn(rows, 2 * n, generator=gen) * 6).to(dtype)
    gate_up[0, 0], gate_up[-1, n - 1] = -200.0, 200.0  # e^x clamped at both ends
    out = cpu_native.silu_mul(variant, gate_up)
    wide = gate_up.double()
    want = F.silu(wide[:, :n]) * wide[:, n:]
    tol = rounded_once(dtype)
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 10])
def test_rope_in_place_matches_the_models_rope(variant: cpu_native.CpuKernels,
                                               dtype: torch.dtype, head_dim: int) -> None:
    """On q and k heads inside a fused qkv row (strided), v heads left as they were."""
    from native_engine.model.llama import apply_rope, rope_tables
    from tests.native_engine.tiny_model import tiny_config

    cfg = tiny_config()
    cfg = type(cfg)(**{**cfg.to_dict(), "head_dim": head_dim})
    cos, sin = rope_tables(cfg)
    positions = torch.tensor([0, 1, 7, cfg.max_position_embeddings - 1])
    qkv = torch.randn(4, 5, head_dim).to(dtype)  # 3 q/k heads, 2 v heads
    want = apply_rope(qkv[:, :3].double(), cos[positions].double().unsqueeze(1),
                      sin[positions].double().unsqueeze(1))
    v = qkv[:, 3:].clone()
    half = head_dim // 2
    checked = cpu_native.Positions.checked(positions, cos.shape[0])
    cpu_native.rope_(variant, qkv[:, :3], checked, cos[:, :half].contiguous(),
                     sin[:, half:].contiguous())
    tol = rounded_once(dtype) * 4
    torch.testing.assert_close(qkv[:, :3].double(), want, atol=tol, rtol=tol)
    assert torch.equal(qkv[:, 3:], v)
    with pytest.raises(ValueError, match="positions"):
        cpu_native.Positions.checked(torch.tensor([0, cos.shape[0]]), cos.shape[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_is_torchs_first_index_and_refuses_nan_and_inf(
        variant: cpu_native.CpuKernels, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 1000, generator=gen).to(dtype)
    x[1, 17] = x[1, 900] = 50.0  # a tie: the first index wins
    x[2, :] = 3.0
    x[3, 999] = 60.0  # in the scalar tail of a vector build
    got = cpu_native.argmax(variant, x)
    assert got[:4].tolist() == x[:4].float().argmax(-1).tolist() and got[1] == 17
    assert got[2] == 0 and got[3] == 999
    x[4, 3], x[5, 998] = float("nan"), float("inf")
    assert cpu_native.argmax(variant, x)[4:].tolist() == [-1, -1]
    assert cpu_native.argmax(variant, x[:3, :5].contiguous()).tolist() == \
        x[:3, :5].float().argmax(-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [8, 64, 72])
@pytest.mark.parametrize("heads", [(9, 3), (4, 1), (2, 2)])
def test_every_build_prefills_as_the_reference(variant: cpu_native.CpuKernels,
                                               dtype: torch.dtype, head_dim: int,
                                               heads: tuple[int, int]) -> None:
    """Whole prompts and chunks after a cached prefix, lengths across tile and block edges;
    q's tokens strided as inside a fused qkv output."""
    new_lens, ctx_lens = [2, 17, 40, 5, 33], [2, 17, 70, 37, 33]
    batch = make_paged_batch(new_lens, ctx_lens, num_q_heads=heads[0], num_kv_heads=heads[1],
                             head_dim=head_dim, page_size=16, dtype=dtype, seed=head_dim)
    ref = torch_ref.paged_attention(*batch.attention_args())
    strided = torch.cat([batch.q, torch.zeros_like(batch.q[:, :1])], dim=1)[:, : heads[0]]
    starts = batch.query_start_loc.tolist()
    for r, ctx in enumerate(ctx_lens):
        blocks = batch.block_tables[r].long()
        out = cpu_native.prefill_attention(variant, strided[starts[r] : starts[r + 1]],
                                           batch.k_cache, batch.v_cache, blocks, ctx,
                                           batch.scale)
        assert not out.isnan().any(), "read an unowned (poisoned) slot"
        tol = tolerance(dtype)
        torch.testing.assert_close(out.double(), ref[starts[r] : starts[r + 1]].double(),
                                   atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="block ids"):
        cpu_native.prefill_attention(variant, batch.q[:2], batch.k_cache, batch.v_cache,
                                     torch.full((8,), batch.k_cache.shape[0]), 2, batch.scale)


def gemm_kernels() -> cpu_native.CpuKernels | None:
    """The kernels where the packed GEMM was built (AVX512-BF16); elsewhere None, once it is
    checked that packing is refused there."""
    kernels = native()
    if kernels.gemm_panel_columns:
        return kernels
    with pytest.raises(ValueError, match="AVX512-BF16"):
        cpu_native.pack_weight(kernels, torch.ones(4, 4, dtype=torch.bfloat16))
    return None


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(0, 40), n=st.integers(1, 100), k=st.integers(1, 80),
       seed=st.integers(0, 2**16))
def test_the_packed_gemm_matches_torch(rows: int, n: int, k: int, seed: int) -> None:
    """Every row count (whole and partial row tiles), widths across panel and vector edges,
    odd K."""
    kernels = gemm_kernels()
    if kernels is None:
        return
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    weight = (torch.randn(n, k, generator=gen) * 0.1).bfloat16()
    got = cpu_native.gemm(kernels, x, cpu_native.pack_weight(kernels, weight))
    want = F.linear(x.double(), weight.double())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)


def test_a_fak_gemm_linear_holds_the_weight_packed_only() -> None:
    from native_engine.kernels.linear import Linear

    if gemm_kernels() is None:
        return
    weight = torch.randn(70, 48).bfloat16()
    linear = Linear(weight, "fak_gemm")
    assert linear.plain is None and linear.wide is None and linear.packed is not None
    assert linear.weight is linear.packed.data and linear.few_rows_kernel == "fak_gemm"
    for rows in (0, 1, 15, 33):
        x = torch.randn(rows, 48).bfloat16()
        torch.testing.assert_close(linear(x).double(), F.linear(x.double(), weight.double()),
                                   atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="bf16"):
        Linear(weight.float(), "fak_gemm")


def test_long_work_takes_every_core_unless_omp_num_threads_says(monkeypatch) -> None:
    import os

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_native._wide_threads() == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert cpu_native._wide_threads() == len(os.sched_getaffinity(0))


def test_threads_do_not_change_a_bit(monkeypatch) -> None:
    """Work split over threads gives the same bits as on one: each panel (GEMM), each block
    of weight rows (GEMV), each row (the elementwise kernels, argmax), each block of
    positions (prefill) and each request's KV head (decode) is computed by one thread in a
    fixed order."""
    kernels = native()
    batch = make_paged_batch([300], [340], num_q_heads=9, num_kv_heads=3, head_dim=64,
                             page_size=16, dtype=torch.bfloat16, seed=3)
    blocks = batch.block_tables[0].long()
    weight = torch.randn(200, 64).bfloat16()
    x = torch.randn(131, 64).bfloat16()
    q = batch.q[:5].contiguous()
    decodes = cpu_native.DecodeTables.checked(
        blocks.repeat(5, 1), torch.tensor([340, 1, 17, 200, 99]), batch.k_cache.shape[0], 16)
    packed = cpu_native.pack_weight(kernels, weight) if kernels.gemm_panel_columns else None
    outs = []
    for threads in (1, 2):
        monkeypatch.setattr(cpu_native, "WIDE_THREADS", threads)
        attention = cpu_native.prefill_attention(kernels, batch.q, batch.k_cache, batch.v_cache,
                                                 blocks, 340, batch.scale)
        decode = cpu_native.decode_attention(kernels, q, batch.k_cache, batch.v_cache, decodes,
                                             batch.scale)
        outs.append((attention, decode,
                     None if packed is None else cpu_native.gemm(kernels, x, packed),
                     *row_kernels(kernels, x, weight)))
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.equal(outs[0][1], outs[1][1])
    if packed is not None:
        assert torch.equal(outs[0][2], outs[1][2])
    for one, two in zip(outs[0][3:], outs[1][3:], strict=True):
        assert torch.equal(one, two)


def row_kernels(kernels: cpu_native.CpuKernels, x: torch.Tensor,
                weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The GEMV (2 rows) and the row-parallel kernels on rows enough for the wide threads."""
    rows = x.shape[0]
    assert rows >= cpu_native.ELEMENTWISE_WIDE_ROWS
    h = x.clone()
    normed = cpu_native.add_rms_norm(kernels, h, x.flip(0).contiguous(), weight[0], 1e-5)
    heads = x.view(rows, 1, 64).clone()
    table = torch.randn(rows, 32, generator=torch.Generator().manual_seed(5))
    cpu_native.rope_(kernels, heads, cpu_native.Positions.checked(
        torch.arange(rows), rows), table, table.flip(1).contiguous())
    return (cpu_native.gemv(kernels, x[:2].contiguous(), weight), h, normed,
            cpu_native.silu_mul(kernels, x), heads, cpu_native.argmax(kernels, x))


def test_elementwise_and_gemm_arguments_are_checked_before_the_c_code_runs() -> None:
    """A shape the C code would read past, or a dtype it would misread, is a ValueError."""
    kernels = native()
    h, weight = torch.randn(3, 8), torch.ones(8)
    bad_calls = {
        "delta": lambda: cpu_native.add_rms_norm(kernels, h, torch.randn(2, 8), weight, 1e-5),
        "h \\[rows, n\\]": lambda: cpu_native.add_rms_norm(kernels, h[:, :4], None,
                                                          weight, 1e-5),
        "weight": lambda: cpu_native.add_rms_norm(kernels, h, None, weight.double(), 1e-5),
        "gate_up": lambda: cpu_native.silu_mul(kernels, torch.randn(3, 7)),
        "n >= 1": lambda: cpu_native.argmax(kernels, torch.randn(3, 0)),
        "x \\[rows, n\\]": lambda: cpu_native.argmax(kernels, torch.randn(6, 4).t()),
        "tables": lambda: cpu_native.rope_(
            kernels, torch.randn(2, 3, 8), cpu_native.Positions.checked(torch.tensor([0, 1]), 4),
            torch.ones(4, 3), torch.ones(4, 3)),
    }
    for what, call in bad_calls.items():
        with pytest.raises(ValueError, match=what):
            call()
    if kernels.gemm_panel_columns:
        packed = cpu_native.pack_weight(kernels, torch.ones(32, 16, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="x \\[M, k\\]"):
            cpu_native.gemm(kernels, torch.ones(2, 8, dtype=torch.bfloat16), packed)
        with pytest.raises(ValueError, match="bf16 x"):
            cpu_native.gemm(kernels, torch.ones(2, 16), packed)
