"""Triton kernels against the torch reference.

Where the kernels run: on CUDA when there is one; otherwise under Triton's CPU interpreter,
which must be switched on (TRITON_INTERPRET=1) before triton decorates the kernels and stays
on for the whole process. So that it cannot leak into other tests of the same pytest run, the
cases live in this file, which pytest does not collect by itself; test_kernels_triton.py runs
it in a child pytest with TRITON_INTERPRET=1 (CPU) or directly on a GPU.

Tolerances, against the fp32 reference on the same (already rounded) inputs, as
|out - ref| <= atol + rtol * |ref|; over 25 random batches the worst error used 7.5% (fp32),
18% (fp16) and 41% (bf16) of that allowance:
fp32 1e-5 + 1e-5 (kernel dots in IEEE fp32); fp16 2e-3 + 2e-3; bf16 1.6e-2 + 1.6e-2 (q, K, V
and the softmax weights are rounded to bf16 before each dot, as on the GPU, and the output is
stored in bf16: half an ulp at |o| ~ 2 is 7.8e-3).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from native_engine.kernels import torch_ref
from native_engine.kernels.paged_batch import make_paged_batch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ON_CUDA = torch.cuda.is_available() and not INTERPRET
RUN_HERE = INTERPRET or ON_CUDA
DEVICE = "cuda" if ON_CUDA else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

if not (INTERPRET or ON_CUDA):
    raise RuntimeError("run with TRITON_INTERPRET=1 or on a CUDA machine (see the docstring)")


def _backend():
    from native_engine.kernels import select_backend

    return select_backend("triton", DEVICE)


def _assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    assert out.dtype == dtype
    assert not out.isnan().any(), "output reads a poisoned (unowned) cache slot"
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), atol=tol, rtol=tol)


def _check_attention(new_lens, ctx_lens, *, hq, hkv, head_dim, page, dtype, block_m, tile_n, seed):
    batch = make_paged_batch(
        new_lens, ctx_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim,
        page_size=page, dtype=dtype, device=DEVICE, seed=seed,
    )
    out = _backend().paged_attention(*batch.attention_args(), block_m=block_m, tile_n=tile_n)
    ref = torch_ref.paged_attention(*batch.to(torch.float32).attention_args())
    _assert_close(out, ref, dtype)


@st.composite
def mixed_batches(
    draw: st.DrawFn, max_ctx: int, max_requests: int = 5
) -> tuple[list[int], list[int]]:
    """Decodes (1 new token), prefill chunks (some new tokens after a cached prefix), full
    prefills (all new) and idle requests (0 new), in any order."""
    new_lens, ctx_lens = [], []
    for _ in range(draw(st.integers(1, max_requests))):
        ctx = draw(st.integers(1, max_ctx))
        kind = draw(st.sampled_from(["decode", "chunk", "prefill", "idle"]))
        n = {"decode": 1, "prefill": ctx, "idle": 0}.get(kind) or draw(st.integers(1, ctx))
        new_lens.append(n)
        ctx_lens.append(ctx)
    if sum(new_lens) == 0:
        new_lens[0] = 1
    return new_lens, ctx_lens


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lens=mixed_batches(max_ctx=64),
    heads=st.sampled_from([(1, 1), (2, 2), (4, 2), (9, 3), (8, 1), (6, 3)]),
    head_dim=st.sampled_from([16, 32, 48, 64, 80]),
    page=st.sampled_from([1, 3, 8, 16, 32]),
    dtype=st.sampled_from(list(TOLERANCE)),
    tiles=st.sampled_from([(16, 16), (16, 32), (32, 16), (64, 64)]),
    seed=st.integers(0, 2**16),
)
def test_attention_short_mixed_batches(lens, heads, head_dim, page, dtype, tiles, seed) -> None:
    new_lens, ctx_lens = lens
    _check_attention(new_lens, ctx_lens, hq=heads[0], hkv=heads[1], head_dim=head_dim,
                     page=page, dtype=dtype, block_m=tiles[0], tile_n=tiles[1], seed=seed)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lens=mixed_batches(max_ctx=2048, max_requests=3),
    dtype=st.sampled_from(list(TOLERANCE)),
    seed=st.integers(0, 2**16),
)
def test_attention_long_mixed_batches(lens, dtype, seed) -> None:
    """Up to 2048 tokens; big tiles keep the interpreter's runtime bounded."""
    new_lens, ctx_lens = lens
    _check_attention(new_lens, ctx_lens, hq=3, hkv=1, head_dim=64, page=16, dtype=dtype,
                     block_m=128, tile_n=256, seed=seed)


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_attention_smollm2_shape(dtype: torch.dtype) -> None:
    """SmolLM2's shape (9 q / 3 KV heads, head 64) with the default launch: a decode at a
    block boundary, a chunk after a cached prefix, a partial last block, a full prefill."""
    _check_attention([1, 1, 12, 1, 7], [300, 256, 290, 37, 7], hq=9, hkv=3, head_dim=64,
                     page=16, dtype=dtype, block_m=16, tile_n=32, seed=1)


def test_attention_full_prefill_2048() -> None:
    _check_attention([2048], [2048], hq=2, hkv=1, head_dim=64, page=16, dtype=torch.bfloat16,
                     block_m=256, tile_n=256, seed=2)


def test_attention_accepts_strided_q() -> None:
    """q as a head slice of a fused QKV projection: a strided token axis."""
    batch = make_paged_batch([3, 1], [5, 9], num_q_heads=4, num_kv_heads=2, head_dim=32,
                             page_size=4, device=DEVICE, seed=3)
    qkv = torch.randn(4, 8, 32, device=DEVICE)
    qkv[:, :4] = batch.q
    args = (qkv[:, :4], *batch.attention_args()[1:])
    out = _backend().paged_attention(*args)
    _assert_close(out, torch_ref.paged_attention(*batch.attention_args()), torch.float32)


def test_attend_stores_then_attends_as_the_reference() -> None:
    """The model's per-step pair: plan once, attend (store the step's K/V, then attention)."""
    batch = make_paged_batch([1, 4, 3], [9, 4, 7], num_q_heads=4, num_kv_heads=2,
                             head_dim=32, page_size=4, seed=4)
    ref = torch_ref.paged_attention(*batch.attention_args())
    page = 4
    new_positions = [torch.arange(ctx - n, ctx) for ctx, n in [(9, 1), (4, 4), (7, 3)]]
    slots = torch.cat([batch.block_tables[r, pos // page].long() * page + pos % page
                       for r, pos in enumerate(new_positions)])
    k_new = batch.k_cache.view(-1, 2, 32)[slots].clone()
    v_new = batch.v_cache.view(-1, 2, 32)[slots].clone()
    caches = [c.clone() for c in (batch.k_cache, batch.v_cache)]
    for c in caches:
        c.view(-1, 2, 32)[slots] = float("nan")
    backend = _backend()
    step = backend.plan(slots.to(DEVICE), batch.block_tables.to(DEVICE),
                        batch.query_start_loc.to(DEVICE), batch.context_lens.to(DEVICE), page)
    moved = [c.to(DEVICE) for c in caches]
    out = backend.attend(batch.q.to(DEVICE), k_new.to(DEVICE), v_new.to(DEVICE), *moved, step,
                         batch.scale)
    _assert_close(out, ref, torch.float32)


@settings(max_examples=30, deadline=None)
@given(
    num_tokens=st.integers(1, 40),
    kv_shape=st.sampled_from([(1, 16), (3, 64), (2, 48), (4, 32)]),
    page=st.sampled_from([1, 5, 16]),
    dtypes=st.sampled_from([(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                            (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)]),
    seed=st.integers(0, 2**16),
)
def test_store_kv_matches_reference(num_tokens, kv_shape, page, dtypes, seed) -> None:
    hkv, head_dim = kv_shape
    src_dtype, cache_dtype = dtypes
    gen = torch.Generator().manual_seed(seed)
    num_slots = page * (num_tokens // page + 3)
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.25] = -1  # padding tokens: skipped
    fused = torch.randn(num_tokens, 2 * hkv + 1, head_dim, generator=gen).to(src_dtype)
    k, v = fused[:, :hkv], fused[:, hkv : 2 * hkv]  # strided views, as split from a projection
    caches = [torch.randn(num_slots // page, page, hkv, head_dim, generator=gen).to(cache_dtype)
              for _ in range(2)]
    moved = [c.to(DEVICE) for c in caches]  # copies: the Triton kernel writes these
    torch_ref.store_kv(k, v, caches[0], caches[1], slots)
    _backend().store_kv(k.to(DEVICE), v.to(DEVICE), *moved, slots.to(DEVICE).to(torch.int32))
    assert torch.equal(moved[0].cpu(), caches[0]) and torch.equal(moved[1].cpu(), caches[1])


def test_attention_rejects_bad_shapes() -> None:
    batch = make_paged_batch([1], [4], num_q_heads=4, num_kv_heads=3, head_dim=16, page_size=4)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        _backend().paged_attention(*batch.attention_args())
    good = make_paged_batch([1], [4], num_q_heads=3, num_kv_heads=3, head_dim=16, page_size=4)
    with pytest.raises(ValueError, match="tile_n"):
        _backend().paged_attention(*good.attention_args(), tile_n=24)
    with pytest.raises(ValueError, match="R\\+1"):
        _backend().paged_attention(*good.attention_args()[:4], good.query_start_loc[:1],
                                   good.context_lens, good.scale)
