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
