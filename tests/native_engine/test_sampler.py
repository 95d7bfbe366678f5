"""Sampler: greedy, temperature, top-k, top-p, seeded reproducibility, logprobs; params checks;
no accepted parameter and no logits row (inf, NaN) makes it fail (issue 11)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from native_engine.request import (
    MIN_TEMPERATURE,
    SAMPLING_EPS,
    SamplingParamError,
    SamplingParams,
)
from native_engine.sampler import LOGPROB_FLOOR, filter_logits, sample

INF, NAN = float("inf"), float("nan")


def test_greedy_takes_argmax_lowest_id_on_ties() -> None:
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 0.0, 0.0, 0.0]])
    out = sample(logits, [SamplingParams(temperature=0)] * 2, [None, None])
    assert [s.token_id for s in out] == [1, 0]
    assert out[0].logprob is None


def test_top_k_and_top_p_masks() -> None:
    row = torch.tensor([1.0, 4.0, 3.0, 2.0])
    assert torch.isfinite(filter_logits(row, 2, 1.0)).tolist() == [False, True, True, False]
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    kept = torch.isfinite(filter_logits(probs, 0, 0.7)).tolist()
    assert kept == [True, True, False, False]  # 0.5 < 0.7, 0.5 + 0.3 covers it
    assert torch.isfinite(filter_logits(probs, 0, 0.1)).tolist() == [True, False, False, False]


def test_seeded_sampling_is_reproducible_and_follows_the_distribution() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    p = SamplingParams(temperature=1.0, seed=5)

    def draw(n: int, seed: int) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return [sample(logits, [p], [g])[0].token_id for _ in range(n)]

    assert draw(50, 5) == draw(50, 5)
    assert draw(50, 5) != draw(50, 6)
    counts = torch.bincount(torch.tensor(draw(2000, 1)), minlength=4).float() / 2000
    expected = logits[0].softmax(-1)
    assert torch.allclose(counts, expected, atol=0.04)
    hot = SamplingParams(temperature=1.0, top_k=1)
    assert {sample(logits, [hot], [None])[0].token_id for _ in range(20)} == {3}


def test_logprobs_are_raw_and_topk_sorted() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    s = sample(logits, [SamplingParams(temperature=0, logprobs=2)], [None])[0]
    ref = logits[0].log_softmax(-1)
    assert s.token_id == 1 and s.logprob == pytest.approx(float(ref[1]))
    assert [t for t, _ in s.top_logprobs] == [1, 2]
    assert s.top_logprobs[1][1] == pytest.approx(float(ref[2]))
    assert sample(logits, [SamplingParams(logprobs=0, temperature=0)], [None])[0].top_logprobs == ()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 0}, {"temperature": -1}, {"temperature": float("nan")}, {"top_p": 0},
        {"top_p": 1.5}, {"top_k": -2}, {"logprobs": 21}, {"stop": [""]}, {"stop": [3]},
        {"stop_token_ids": [-1]}, {"priority": 1.5}, {"namespace": 3}, {"max_tokens": True},
    ],
)
def test_bad_params_are_refused(kwargs: dict) -> None:
    with pytest.raises(SamplingParamError) as caught:
        SamplingParams(**kwargs)
    assert caught.value.param == next(iter(kwargs))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"seed": 2**64}, {"seed": -(2**63) - 1}, {"temperature": 10**400}, {"top_p": 10**400},
        {"temperature": True}, {"stop": 5}, {"stop_token_ids": 7.5},
    ],
)
def test_params_the_engine_cannot_honour_are_refused_by_name(kwargs: dict) -> None:
    """Each of these used to pass and then fail inside the engine (seed in torch's generator,
    a huge int in the float maths) or raise a TypeError."""
    with pytest.raises(SamplingParamError) as caught:
        SamplingParams(**kwargs)
    assert caught.value.param == next(iter(kwargs))


def test_temperatures_follow_vllms_epsilon_and_floor() -> None:
    for t in (0, 1e-45, 5e-324, SAMPLING_EPS / 2):
        p = SamplingParams(temperature=t, top_k=3, top_p=0.5)
        assert p.greedy and (p.top_k, p.top_p) == (0, 1.0)
    for t in (SAMPLING_EPS, 1e-3, MIN_TEMPERATURE / 2):
        p = SamplingParams(temperature=t)
        assert not p.greedy and p.temperature == MIN_TEMPERATURE
    assert SamplingParams(temperature=0.7).temperature == 0.7
    assert SamplingParams(seed=-1).seed is None  # vLLM's "no seed"


def test_sub_epsilon_temperature_samples_the_argmax() -> None:
    """The issue's request: `logits / 1e-45` overflowed and multinomial raised."""
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9]])
    out = sample(logits, [SamplingParams(temperature=1e-45, logprobs=1)], [None])[0]
    assert out.token_id == 1 and math.isfinite(out.logprob)


def test_non_finite_rows_fall_back_to_the_argmax() -> None:
    rows = torch.tensor([[NAN, 1.0, NAN], [-INF, -INF, -INF], [NAN, NAN, NAN],
                         [1.0, INF, INF], [3e38, -3e38, 0.0]])
    hot = SamplingParams(temperature=MIN_TEMPERATURE, logprobs=2)
    out = sample(rows, [hot] * len(rows), [None] * len(rows))
    assert [s.token_id for s in out][:2] == [1, 0]
    assert out[3].token_id in (1, 2) and out[4].token_id == 0
    for s in out:
        assert math.isfinite(s.logprob) and s.logprob >= LOGPROB_FLOOR
        assert all(math.isfinite(lp) for _, lp in s.top_logprobs)


def test_huge_temperature_is_uniform_over_finite_tokens() -> None:
    logits = torch.tensor([[0.0, 5.0, 10.0, -INF]])
    p = SamplingParams(temperature=1e300, seed=1)
    g = torch.Generator().manual_seed(1)
    counts = torch.bincount(torch.tensor([sample(logits, [p], [g])[0].token_id
                                          for _ in range(1500)]), minlength=4)
    assert counts[3] == 0 and torch.allclose(counts[:3].float() / 1500, torch.full((3,), 1 / 3),
                                             atol=0.05)


any_float = st.floats(allow_nan=True, allow_infinity=True)
row_values = st.one_of(any_float, st.sampled_from([INF, -INF, NAN, 0.0, 3.4e38, -3.4e38]))


@settings(max_examples=300, deadline=None)
@given(
    rows=st.integers(1, 4).flatmap(lambda n: st.integers(1, 12).flatmap(
        lambda v: st.lists(st.lists(row_values, min_size=v, max_size=v), min_size=n,
                           max_size=n))),
    temperature=st.one_of(any_float, st.integers(-5, 10**400)),
    top_p=st.one_of(any_float, st.integers(-2, 2)),
    top_k=st.one_of(st.integers(-3, 40), st.integers(min_value=2**62)),
    logprobs=st.one_of(st.none(), st.integers(-1, 25)),
    seed=st.one_of(st.none(), st.integers(-(2**65), 2**65)),
)
def test_sampler_never_fails_on_accepted_params(rows: list[list[float]], temperature: object,
                                                top_p: object, top_k: int,
                                                logprobs: int | None, seed: int | None) -> None:
    """Arbitrary floats and ints: SamplingParams refuses by name or sampling always returns
    a valid token id with finite logprobs."""
    kwargs = dict(temperature=temperature, top_p=top_p, top_k=top_k, logprobs=logprobs,
                  seed=seed)
    try:
        params = SamplingParams(**kwargs)  # type: ignore[arg-type]
    except SamplingParamError as exc:
        assert exc.param in {f.name for f in dataclasses.fields(SamplingParams)}
        return
    logits = torch.tensor(rows, dtype=torch.float32)
    mixed = [params, dataclasses.replace(params, temperature=0.0)][: len(rows)]
    mixed += [params] * (len(rows) - len(mixed))
    gens = [None if seed is None else torch.Generator().manual_seed(seed)] * len(rows)
    for batch in ([params] * len(rows), mixed):
        for s in sample(logits, batch, gens):
            assert 0 <= s.token_id < logits.shape[1]
            if s.logprob is not None:
                assert math.isfinite(s.logprob)
                assert all(math.isfinite(lp) for _, lp in s.top_logprobs or ())


def test_params_normalise() -> None:
    p = SamplingParams(stop="x", stop_token_ids=[1, 2], top_k=-1)
    assert p.stop == ("x",) and p.stop_token_ids == (1, 2) and p.top_k == 0


@settings(max_examples=150, deadline=None)
@given(rows=st.integers(1, 5).flatmap(lambda n: st.integers(1, 40).flatmap(
           lambda v: st.lists(st.lists(row_values, min_size=v, max_size=v), min_size=n,
                              max_size=n))),
       bf16=st.booleans())
def test_greedy_batches_take_the_first_argmax_of_the_nan_masked_row(rows: list[list[float]],
                                                                   bf16: bool) -> None:
    """The all-greedy fast path (one pass in the logits' own dtype) and the general path give
    the same tokens: the first index of each row's largest value, NaNs masked."""
    logits = torch.tensor(rows, dtype=torch.float32)
    if bf16:
        logits = logits.bfloat16()
    wide = logits.float()
    want = wide.masked_fill(wide.isnan(), -INF).argmax(-1).tolist()
    greedy = [SamplingParams(temperature=0)] * len(rows)
    assert [s.token_id for s in sample(logits, greedy, [None] * len(rows))] == want
