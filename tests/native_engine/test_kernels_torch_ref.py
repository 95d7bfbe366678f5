"""The torch reference against a dense float64 restatement of the contract, and select_backend."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from native_engine.kernels import select_backend, torch_fast, torch_ref
from native_engine.kernels.paged_batch import make_paged_batch


def dense_attention(batch) -> torch.Tensor:
    """Literal contract: query i of request r sits at position ctx - n + i and attends to
    keys 0..position; K/V read slot by slot through the block table; float64 throughout."""
    q, k_cache, v_cache, tables, starts, ctx_lens, scale = batch.attention_args()
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // hkv
    out = torch.zeros(q.shape, dtype=torch.float64)
    for r, ctx in enumerate(ctx_lens.tolist()):
        lo, hi = int(starts[r]), int(starts[r + 1])
        slots = [int(tables[r, p // page]) * page + p % page for p in range(ctx)]
        k = k_cache.reshape(-1, hkv, q.shape[2])[slots].double()
        v = v_cache.reshape(-1, hkv, q.shape[2])[slots].double()
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [ctx, Hq, D]
        for i in range(hi - lo):
            seen = ctx - (hi - lo) + i + 1
            scores = torch.einsum("hd,khd->hk", q[lo + i].double(), k[:seen]) * scale
            out[lo + i] = torch.einsum("hk,khd->hd", scores.softmax(1), v[:seen])
    return out


@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.tuples(st.integers(0, 24), st.integers(0, 24)), min_size=1, max_size=5),
    heads=st.sampled_from([(1, 1), (4, 2), (9, 3), (8, 1)]),
    head_dim=st.sampled_from([8, 64]),
    page=st.sampled_from([1, 4, 16]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_paged_attention_matches_dense(shape, heads, head_dim, page, dtype, seed) -> None:
    """Decodes, chunks after a cached prefix, full prefills and idle requests mixed."""
    ctx_lens = [max(1, cached + new) for new, cached in shape]
    new_lens = [min(new, ctx) for (new, _), ctx in zip(shape, ctx_lens, strict=True)]
    batch = make_paged_batch(new_lens, ctx_lens, num_q_heads=heads[0], num_kv_heads=heads[1],
                             head_dim=head_dim, page_size=page, dtype=dtype, seed=seed)
    out = torch_ref.paged_attention(*batch.attention_args())
    assert out.dtype == dtype and not out.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), dense_attention(batch), atol=tol, rtol=tol)


def test_output_of_a_request_ignores_the_rest_of_the_batch() -> None:
    """Batch-1 vs batch-N: each request's attention output is bitwise the same."""
    new_lens, ctx_lens = [1, 7, 1, 30], [50, 19, 3, 30]
    shapes = dict(num_q_heads=9, num_kv_heads=3, head_dim=64, page_size=16)
    full = make_paged_batch(new_lens, ctx_lens, **shapes, seed=5)
    out = torch_ref.paged_attention(*full.attention_args())
    for r in range(len(new_lens)):
        lo, hi = int(full.query_start_loc[r]), int(full.query_start_loc[r + 1])
        single = torch_ref.paged_attention(
            full.q[lo:hi], full.k_cache, full.v_cache, full.block_tables[r : r + 1],
            torch.tensor([0, hi - lo], dtype=torch.int32), full.context_lens[r : r + 1],
            full.scale,
        )
        assert torch.equal(single, out[lo:hi])


@settings(max_examples=40, deadline=None)
@given(num_tokens=st.integers(1, 30), page=st.sampled_from([1, 4, 16]), seed=st.integers(0, 99))
def test_store_kv_writes_each_slot_and_skips_minus_one(num_tokens, page, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_slots = page * (num_tokens // page + 2)
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.3] = -1
    k, v = torch.randn(2, num_tokens, 3, 8, generator=gen)
    k_cache = torch.zeros(num_slots // page, page, 3, 8, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    torch_ref.store_kv(k, v, k_cache, v_cache, slots)
    written = set()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            written.add(slot)
            assert torch.equal(k_cache[slot // page, slot % page], k[t].bfloat16())
            assert torch.equal(v_cache[slot // page, slot % page], v[t].bfloat16())
    untouched = [s for s in range(num_slots) if s not in written]
    assert not k_cache.view(-1, 3, 8)[untouched].any()


def test_select_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    from native_engine.kernels import cpu_backend, cpu_native

    # This machine builds fak's C kernels (CI's too: gcc is there), so auto takes them.
    assert select_backend("auto", "cpu") is cpu_backend
    assert select_backend("cpu", "cpu") is cpu_backend
    assert select_backend("torch", "cpu") is torch_fast
    with pytest.raises(ValueError, match="cpu attention backend needs"):
        select_backend("cpu", "cuda")
    monkeypatch.setattr(cpu_native, "load", lambda: None)  # where they did not build
    assert select_backend("auto", "cpu") is torch_fast
    with pytest.raises(ValueError, match="did not build here"):
        select_backend("cpu", "cpu")
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_backend("flash", "cpu")
    from native_engine.kernels import triton_backend

    if triton_backend.INTERPRETED:
        assert select_backend("triton", "cpu") is triton_backend
    else:
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            select_backend("triton", "cpu")


def test_auto_is_triton_on_cuda() -> None:
    """The choice depends on the device asked for, not on this machine having one."""
    from native_engine.kernels import triton_backend

    assert select_backend("auto", "cuda") is triton_backend


def test_paged_batch_rejects_impossible_lengths() -> None:
    with pytest.raises(ValueError, match="0 <= n <= ctx"):
        make_paged_batch([5], [3], num_q_heads=1, num_kv_heads=1, head_dim=8, page_size=4)
