"""Token sampling: greedy, temperature, top-k, top-p, per-request seeded generators, logprobs.

Logprobs are those of the raw model distribution (log-softmax of the logits before
temperature and filters), as vLLM reports by default. Greedy ties go to the lowest token id.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from native_engine.request import SamplingParams


@dataclass(frozen=True, slots=True)
class Sample:
    """The chosen token; with logprobs requested, its logprob and the top alternatives."""

    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside the top k and outside the smallest top-p nucleus of a
    1-D logits row; the most likely token always survives."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # mass before this token already covers p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample_row(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> int:
    if params.greedy:
        return int(logits.argmax())
    scaled = filter_logits(logits / params.temperature, params.top_k, params.top_p)
    probs = scaled.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[Sample]:
    """One token per row of `logits` [R, vocab] (float32, on CPU or device)."""
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError("need one params and generator per logits row")
    logits = logits.float().cpu()
    if all(p.greedy for p in params):
        tokens = logits.argmax(-1).tolist()
    else:
        rows = zip(logits, params, generators, strict=True)
        tokens = [sample_row(row, p, g) for row, p, g in rows]
    out = []
    for row, token, p in zip(logits, tokens, params, strict=True):
        if p.logprobs is None:
            out.append(Sample(token))
            continue
        logprobs = row.log_softmax(-1)
        top = torch.topk(logprobs, p.logprobs) if p.logprobs else None
        alternatives = (
            tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top else ()
        )
        out.append(Sample(token, float(logprobs[token]), alternatives))
    return out
