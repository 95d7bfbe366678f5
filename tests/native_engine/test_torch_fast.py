"""torch_fast (batched decode) against the torch_ref oracle on random mixed paged batches."""

from __future__ import annotations

from unittest import mock

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from native_engine.kernels import cpu_backend, select_backend, torch_fast, torch_ref
from native_engine.kernels.cpu_features import AMX_BF16
from native_engine.kernels.paged_batch import make_paged_batch

HEADS = st.sampled_from([(1, 1), (4, 2), (9, 3), (8, 1)])


def assert_matches_reference(new_lens, ctx_lens, heads, head_dim, page, dtype, seed) -> None:
    batch = make_paged_batch(new_lens, ctx_lens, num_q_heads=heads[0], num_kv_heads=heads[1],
                             head_dim=head_dim, page_size=page, dtype=dtype, seed=seed)
    fast = torch_fast.paged_attention(*batch.attention_args())
    ref = torch_ref.paged_attention(*batch.attention_args())
    assert fast.dtype == dtype and fast.shape == ref.shape
    assert not fast.isnan().any(), "read an unowned (poisoned) slot"
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fast.double(), ref.double(), atol=tol, rtol=tol)


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.tuples(st.integers(0, 24), st.integers(0, 40)), min_size=1, max_size=6),
    heads=HEADS,
    head_dim=st.sampled_from([8, 64]),
    page=st.sampled_from([1, 4, 16]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_mixed_batches_match_reference(shape, heads, head_dim, page, dtype, seed) -> None:
    """Decodes, chunks after a cached prefix, full prefills and idle requests mixed."""
    ctx_lens = [max(1, cached + new) for new, cached in shape]
    new_lens = [min(new, ctx) for (new, _), ctx in zip(shape, ctx_lens, strict=True)]
    assert_matches_reference(new_lens, ctx_lens, heads, head_dim, page, dtype, seed)


@settings(max_examples=40, deadline=None)
@given(
    ctx_lens=st.lists(st.integers(1, 70), min_size=1, max_size=12),
    heads=HEADS,
    page=st.sampled_from([1, 4, 16]),
    seed=st.integers(0, 2**16),
)
def test_decode_only_batches_of_uneven_contexts(ctx_lens, heads, page, seed) -> None:
    """All rows on the batched path; short contexts padded next to long ones."""
    assert_matches_reference([1] * len(ctx_lens), ctx_lens, heads, 64, page, torch.float32, seed)


def test_store_kv_is_the_reference_one() -> None:
    assert torch_fast.store_kv is torch_ref.store_kv


def test_the_torch_backend_is_torch_fast() -> None:
    assert select_backend("torch", "cpu") is torch_fast


def new_token_slots(batch) -> torch.Tensor:
    """Slot of every new token (the last positions of each request's context)."""
    page = batch.k_cache.shape[1]
    slots = []
    starts = batch.query_start_loc.tolist()
    for r, ctx in enumerate(batch.context_lens.tolist()):
        n = starts[r + 1] - starts[r]
        pos = torch.arange(ctx - n, ctx)
        slots.append(batch.block_tables[r, pos // page].long() * page + pos % page)
    return torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64)


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.tuples(st.integers(0, 24), st.integers(0, 40)), min_size=1, max_size=6),
    heads=HEADS,
    page=st.sampled_from([1, 4, 16]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_attend_with_the_steps_fresh_kv_matches_reference(shape, heads, page, dtype, seed) -> None:
    """The model's path: plan once, attend with the step's own K/V (stored on the way; a
    prompt with nothing cached reads them directly, causally) equals the oracle, for the
    torch backend and the cpu one (its decodes through the C kernel; its fresh bf16 prompts
    through SDPA where the CPU has AMX, here both ways on any CPU)."""
    attend_fresh_kv(torch_fast, shape, heads, page, dtype, seed)
    for amx in (False, True):
        with (mock.patch.object(cpu_backend, "AMX_BF16", amx),
              mock.patch.object(cpu_backend, "SDPA_PREFILL_TOKENS", 1)):
            attend_fresh_kv(cpu_backend, shape, heads, page, dtype, seed)


def test_fresh_bf16_prompts_take_sdpa_on_amx_and_match_the_c_kernel() -> None:
    """A long bf16 prompt with nothing cached goes to SDPA where AMX is (its flash kernel's
    GEMMs on the tiles); a shorter one, a chunk after a cached prefix, and fp32, stay with
    the C kernel. Both paths agree within bf16 rounding."""
    long = cpu_backend.SDPA_PREFILL_TOKENS
    outs = {}
    for amx in (False, True):
        with (mock.patch.object(cpu_backend, "AMX_BF16", amx),
              mock.patch.object(torch_fast, "sdpa_prefill",
                                wraps=torch_fast.sdpa_prefill) as sdpa):
            outs[amx] = attend_once([(long, 0), (long - 1, 0), (24, 16), (1, 30)],
                                    torch.bfloat16)
        assert sdpa.call_count == (1 if amx else 0)  # only the long fresh prompt
    torch.testing.assert_close(outs[True].double(), outs[False].double(), atol=2e-2, rtol=2e-2)
    with (mock.patch.object(cpu_backend, "AMX_BF16", True),
          mock.patch.object(torch_fast, "sdpa_prefill") as sdpa):
        attend_once([(long, 0)], torch.float32)
    assert sdpa.call_count == 0


def attend_once(shape: list[tuple[int, int]], dtype: torch.dtype) -> torch.Tensor:
    """cpu_backend.attend over one batch of (new, cached) requests, with the step's K/V."""
    ctx_lens = [new + cached for new, cached in shape]
    batch = make_paged_batch([new for new, _ in shape], ctx_lens, num_q_heads=9,
                             num_kv_heads=3, head_dim=64, page_size=16, dtype=dtype, seed=7)
    slots = new_token_slots(batch)
    k_new = batch.k_cache.view(-1, 3, 64)[slots].clone()
    v_new = batch.v_cache.view(-1, 3, 64)[slots].clone()
    step = cpu_backend.plan(slots, batch.block_tables, batch.query_start_loc,
                            batch.context_lens, 16, num_blocks=batch.k_cache.shape[0])
    return cpu_backend.attend(batch.q, k_new, v_new, batch.k_cache.clone(),
                              batch.v_cache.clone(), step, batch.scale)


def attend_fresh_kv(backend, shape, heads, page, dtype, seed) -> None:
    ctx_lens = [max(1, cached + new) for new, cached in shape]
    new_lens = [min(new, ctx) for (new, _), ctx in zip(shape, ctx_lens, strict=True)]
    batch = make_paged_batch(new_lens, ctx_lens, num_q_heads=heads[0], num_kv_heads=heads[1],
                             head_dim=64, page_size=page, dtype=dtype, seed=seed)
    ref = torch_ref.paged_attention(*batch.attention_args())
    slots = new_token_slots(batch)
    flat_k = batch.k_cache.view(-1, *batch.k_cache.shape[2:])
    flat_v = batch.v_cache.view(-1, *batch.v_cache.shape[2:])
    k_new, v_new = flat_k[slots].clone(), flat_v[slots].clone()
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = float("nan")  # attend must write them
    v_cache.view(-1, *v_cache.shape[2:])[slots] = float("nan")
    step = backend.plan(slots, batch.block_tables, batch.query_start_loc, batch.context_lens,
                        page, num_blocks=k_cache.shape[0])
    out = backend.attend(batch.q, k_new, v_new, k_cache, v_cache, step, batch.scale)
    assert not out.isnan().any(), "read an unowned (poisoned) or unwritten slot"
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref.double(), atol=tol, rtol=tol)
    assert torch.equal(k_cache.view(-1, *k_cache.shape[2:])[slots], k_new)
    assert torch.equal(v_cache.view(-1, *v_cache.shape[2:])[slots], v_new)


def test_plan_skips_unstored_slots() -> None:
    """Slots of -1 are not written; the rest are, from the matching rows."""
    batch = make_paged_batch([3], [3], num_q_heads=2, num_kv_heads=1, head_dim=8, page_size=4)
    slots = new_token_slots(batch)
    slots[1] = -1
    step = torch_fast.plan(slots, batch.block_tables, batch.query_start_loc,
                           batch.context_lens, 4)
    assert step.store_rows is not None and step.store_rows.tolist() == [0, 2]
    k = torch.randn(3, 1, 8)
    cache = torch.zeros_like(batch.k_cache)
    torch_fast.attend(batch.q, k, k, cache, cache.clone(), step, batch.scale)
    flat = cache.view(-1, 1, 8)
    skipped = int(new_token_slots(batch)[1])
    assert torch.equal(flat[slots[[0, 2]]], k[[0, 2]]) and not flat[skipped].any()


def test_decodes_attend_in_fp32_where_bf16_sdpa_is_slow() -> None:
    """Half-precision decodes attend in fp32 on a CPU without AMX, in the model's dtype
    elsewhere; fp32 stays fp32 (the mixed-batch tests above check the values)."""
    cpu = torch.device("cpu")
    assert torch_fast.decode_dtype(torch.float32, cpu) == torch.float32
    want = torch.bfloat16 if AMX_BF16 else torch.float32
    assert torch_fast.decode_dtype(torch.bfloat16, cpu) == want
    assert torch_fast.decode_dtype(torch.bfloat16, torch.device("cuda")) == torch.bfloat16
