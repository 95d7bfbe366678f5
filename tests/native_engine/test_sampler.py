"""Sampler: greedy, temperature, top-k, top-p, seeded reproducibility, logprobs; params checks."""

from __future__ import annotations

import pytest
import torch

from native_engine.request import SamplingParams
from native_engine.sampler import filter_logits, sample


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
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_params_normalise() -> None:
    p = SamplingParams(stop="x", stop_token_ids=[1, 2], top_k=-1)
    assert p.stop == ("x",) and p.stop_token_ids == (1, 2) and p.top_k == 0
