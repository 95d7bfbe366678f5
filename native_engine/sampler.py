"""Token sampling: greedy, temperature, top-k, top-p, per-request seeded generators, logprobs.

Logprobs are those of the raw model distribution (log-softmax of the logits before
temperature and filters), as vLLM reports by default; a -inf or undefined one is reported as
LOGPROB_FLOOR, vLLM's floor in its API. Greedy ties go to the lowest token id.

Sampling cannot fail on accepted parameters: rows are sampled in float32 with NaN logits
masked, shifted so the largest is 0 before dividing by the temperature (nothing overflows);
a row whose distribution is still degenerate (all masked, or +inf logits) takes its argmax.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from native_engine.kernels import cpu_native
from native_engine.request import SamplingParams

LOGPROB_FLOOR = -9999.0
FLOAT32_MAX = torch.finfo(torch.float32).max


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
    """One token from a 1-D float32 row whose NaNs are already masked to -inf."""
    top = logits.max()
    if params.greedy or not bool(torch.isfinite(top)):
        return int(logits.argmax())
    # <= 0 everywhere, the top at 0, and a float32 divisor: no overflow and no inf/inf NaN,
    # so the filtered softmax is finite with the top's weight 1 (filters keep the top).
    scaled = (logits - top) / min(params.temperature, FLOAT32_MAX)
    probs = filter_logits(scaled, params.top_k, params.top_p).softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def _greedy_fast(logits: torch.Tensor, params: Sequence[SamplingParams]) -> list[int] | None:
    """The tokens of an all-greedy batch without logprobs, in one pass over the logits in
    their own dtype (fak's C kernel, on a CPU): the same first-index argmax. None where the
    kernel is missing or a row holds a NaN or an infinity: the general path decides."""
    if logits.device.type != "cpu" or logits.dtype not in cpu_native.SUFFIX \
            or not all(p.greedy and p.logprobs is None for p in params):
        return None
    kernels = cpu_native.load()
    if kernels is None:
        return None
    tokens = cpu_native.argmax(kernels, logits.contiguous())
    return None if bool((tokens < 0).any()) else tokens.tolist()


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[Sample]:
    """One token per row of `logits` [R, vocab] (any float dtype, on CPU or device; sampled
    in float32)."""
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError("need one params and generator per logits row")
    greedy = _greedy_fast(logits, params)
    if greedy is not None:
        return [Sample(token) for token in greedy]
    logits = logits.float().cpu()
    logits = logits.masked_fill(logits.isnan(), float("-inf"))
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
        logprobs = row.log_softmax(-1).nan_to_num(nan=LOGPROB_FLOOR).clamp_min(LOGPROB_FLOOR)
        k = min(p.logprobs, logprobs.numel())
        top = torch.topk(logprobs, k) if k else None
        alternatives = (
            tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top else ()
        )
        out.append(Sample(token, float(logprobs[token]), alternatives))
    return out
