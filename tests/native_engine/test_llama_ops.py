"""The model's fused pieces against their plain definitions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from native_engine.kernels import cpu_native, torch_fast
from native_engine.kernels.cpu_features import AMX_BF16
from native_engine.kernels.linear import (
    GEMV_ROWS,
    NATIVE_GEMV_ROWS,
    SGEMV_ROWS,
    Linear,
    choose_linear,
    onednn_packs,
)
from native_engine.model.llama import (
    LlamaModel,
    apply_rope,
    rms_norm,
    rope_inv_freq,
    rope_tables,
)
from tests.native_engine.tiny_model import random_model, tiny_config


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), width=st.sampled_from([8, 64, 576]), seed=st.integers(0, 999))
def test_rms_norm_is_hf_bit_for_bit_in_fp32(rows: int, width: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x, weight = torch.randn(rows, width, generator=gen), torch.randn(width, generator=gen)
    assert torch.equal(rms_norm(x, weight, 1e-5), hf_rms_norm(x, weight, 1e-5))


def test_rope_matches_hf_rotate_half() -> None:
    cfg = tiny_config()
    positions = torch.tensor([0, 1, 7, 300])
    x = torch.randn(4, 6, cfg.head_dim)
    cos, sin = rope_tables(cfg)
    out = apply_rope(x, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    angles = positions.float()[:, None] * rope_inv_freq(cfg)[None, :]
    half = cfg.head_dim // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)
    want = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_onednn_packed_linear_equals_aten(rows: int) -> None:
    """The packed path (what bf16 AMX machines run), exercised in fp32, which every
    oneDNN CPU packs."""
    assert onednn_packs(torch.float32)
    weight, x = torch.randn(96, 40), torch.randn(rows, 40)
    packed = Linear(weight, "onednn")
    torch.testing.assert_close(packed(x), F.linear(x, weight), atol=1e-4, rtol=1e-5)
    assert torch.equal(Linear(weight, "aten")(x), F.linear(x, weight))
    with pytest.raises(ValueError, match="linear kind"):
        Linear(weight, "int8")


@pytest.mark.parametrize("shape", [(96, 40), (40, 96)])
@pytest.mark.parametrize("rows", [1, NATIVE_GEMV_ROWS, NATIVE_GEMV_ROWS + 1, 64])
def test_few_rows_run_the_c_gemv_and_more_the_packed_copy(
        rows: int, shape: tuple[int, int]) -> None:
    """Up to NATIVE_GEMV_ROWS rows exactly the C GEMV's product on the plain weight, past
    them the packed copy's; equal up to fp32 summation order (this machine builds the C
    kernels, as CI's does)."""
    weight = torch.randn(*shape)
    x = torch.randn(rows, shape[1])
    linear = Linear(weight, "onednn_gemm")
    kernels = cpu_native.load()
    assert kernels is not None and linear.native is kernels
    assert linear.plain is weight and not linear.transposed and linear.wide is not None
    out = linear(x)
    if rows <= NATIVE_GEMV_ROWS:
        want = cpu_native.gemv(kernels, x, weight)
    else:
        want = torch.ops.mkldnn._linear_pointwise(x, linear.wide, None, "none", [], "")
    assert torch.equal(out, want)
    torch.testing.assert_close(out, F.linear(x, weight), atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="float32 weight"):
        Linear(weight.bfloat16(), "onednn_gemm")


@pytest.mark.parametrize("shape", [(96, 40), (40, 96)])
@pytest.mark.parametrize("rows", [1, SGEMV_ROWS + 1, 64])
def test_without_the_c_kernels_one_row_is_mkl_and_more_onednn(
        rows: int, shape: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the C kernels did not build: up to SGEMV_ROWS rows exactly MKL's product on the
    [in, out] copy where the output is at least as wide as the input, on the plain weight
    where it is narrower; past them the packed copy's."""
    monkeypatch.setattr(cpu_native, "load", lambda: None)
    weight = torch.randn(*shape)
    x = torch.randn(rows, shape[1])
    linear = Linear(weight, "onednn_gemm")
    assert linear.native is None and linear.plain is None
    assert linear.transposed == (shape[0] >= shape[1]) and linear.wide is not None
    if linear.transposed:
        assert linear.weight.shape == shape[::-1] and linear.weight.is_contiguous()
        assert torch.equal(linear.weight.t(), weight)
    else:
        assert linear.weight is weight
    out = linear(x)
    if rows <= SGEMV_ROWS:
        want = torch.mm(x, linear.weight) if linear.transposed else F.linear(x, weight)
    else:
        want = torch.ops.mkldnn._linear_pointwise(x, linear.wide, None, "none", [], "")
    assert torch.equal(out, want)
    torch.testing.assert_close(out, F.linear(x, weight), atol=1e-4, rtol=1e-5)


ONEDNN_KINDS = [("onednn", torch.float32), ("onednn_gemm", torch.float32),
                ("widened", torch.bfloat16)] + (
    [("onednn", torch.bfloat16)] if onednn_packs(torch.bfloat16) else [])


@pytest.mark.parametrize("kind,dtype", [*ONEDNN_KINDS, ("aten", torch.float32)])
def test_onednn_linears_past_few_rows_take_the_wide_threads_with_the_same_bits(
        kind: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past `few_rows` a oneDNN-packed GEMM runs on the C kernels' thread count, then
    torch's own count is back, and one thread or two give the same bits; aten's (MKL's
    sgemm changes bits with the thread count) stays on torch's count."""
    weight = torch.randn(96, 40).to(dtype)
    linear = Linear(weight, kind)
    seen: list[int] = []
    narrow = torch.get_num_threads()
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (seen.append(n), real(n))[1])
    for rows in (5, 9, 37):
        x = torch.randn(rows, 40).to(dtype)
        outs = []
        for wide in (1, 2):
            monkeypatch.setattr(cpu_native, "WIDE_THREADS", wide)
            outs.append(linear(x))
            assert torch.get_num_threads() == narrow
        assert torch.equal(outs[0], outs[1])
    if kind == "aten":
        assert not seen and torch.equal(outs[1], F.linear(x, weight))
    else:
        assert 2 in seen or narrow >= 2


def test_a_tied_embedding_is_read_through_the_heads_transposed_copy() -> None:
    """With a transposed fp32 head the embedding is a view of the head's [in, out] copy: the
    same numbers, held once."""
    loaded = random_model(seed=3)
    embed = loaded.weights["model.embed_tokens.weight"].clone()
    model = LlamaModel(loaded.config, loaded.weights, torch.float32, torch.device("cpu"),
                       torch_fast)
    if not model.lm_head.transposed:
        assert model.embed is model.lm_head.weight
        return
    assert model.embed.data_ptr() == model.lm_head.weight.data_ptr()
    assert torch.equal(model.embed, embed)
    ids = torch.tensor([0, 7, 258, 7])
    assert torch.equal(model.embed[ids], embed[ids])


def test_linear_choice_per_dtype_and_device() -> None:
    cpu = torch.device("cpu")
    x86 = torch.backends.cpu.get_cpu_capability().startswith("AVX")
    want_fp32 = "onednn_gemm" if x86 and onednn_packs(torch.float32) else "aten"
    assert choose_linear(torch.float32, cpu) == want_fp32
    assert choose_linear(torch.float32, torch.device("cuda")) == "aten"
    assert choose_linear(torch.bfloat16, torch.device("cuda")) == "aten"
    without_gemm = "onednn" if onednn_packs(torch.bfloat16) else "widened"
    kernels = cpu_native.load()
    packs = kernels is not None and kernels.gemm_panel_columns > 0 and not AMX_BF16
    assert choose_linear(torch.bfloat16, cpu) == ("fak_gemm" if packs else without_gemm)


def test_without_the_c_kernels_bf16_runs_onednn_or_widened(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_native, "load", lambda: None)
    want = "onednn" if onednn_packs(torch.bfloat16) else "widened"
    assert choose_linear(torch.bfloat16, torch.device("cpu")) == want


@pytest.mark.parametrize("rows", [1, GEMV_ROWS, GEMV_ROWS + 1, 64])
def test_widened_linear_is_bf16_math_on_either_side_of_the_threshold(rows: int) -> None:
    """Both sides compute the bf16 values with fp32 accumulation and round once: each equals
    the fp32 product of the same bf16 numbers rounded to bf16, up to one bf16 step."""
    weight = torch.randn(96, 40).bfloat16()
    x = torch.randn(rows, 40).bfloat16()
    linear = Linear(weight, "widened")
    assert linear.wide is not None and linear.wide.dtype == torch.float32
    assert linear.packed_wide == onednn_packs(torch.float32)
    copy = linear.wide.to_dense() if linear.packed_wide else linear.wide
    assert torch.equal(copy.bfloat16(), weight)  # the copy holds the same values
    out = linear(x)
    assert out.dtype == torch.bfloat16
    want = F.linear(x.float(), weight.float())
    torch.testing.assert_close(out.float(), want, atol=0, rtol=2 ** -7)
    if rows > GEMV_ROWS:  # an fp32 GEMM on the copy: exactly its product, rounded
        gemm = (torch.ops.mkldnn._linear_pointwise(x.float(), linear.wide, None, "none", [], "")
                if linear.packed_wide else want)
        assert torch.equal(out, gemm.bfloat16())
    with pytest.raises(ValueError, match="bf16 weight"):
        Linear(weight.float(), "widened")
