"""Which (upstream, rank) serves a request (docs/design.md §7, docs/operations.md §7).

Pure: the caller measures, this decides. For each rank that is up:

- `overlap` = leading full blocks of the prompt the rank's shadow index holds **in the
  request's own namespace** (the salted chain, so another tenant's blocks never count);
  0 when the rank's index is not SYNCED (UNCERTAIN or STALE earn no credit);
- `load` = max(requests the governor has in flight there, running + waiting from the rank's
  metrics) — the governor's count is current, the scrape also sees other clients;

    kv_aware:     cost = overlap_weight × (⌈prompt_tokens / block_size⌉ − overlap)
                         + load_weight × load
    least_loaded: cost = load
    round_robin:  cost = 0

lowest cost first; ties go to the lower load, then round-robin from the request's turn (so
equal ranks share the work). This is Dynamo's KV-router cost (prefill blocks to compute
plus the worker's load, each weighted) with llm-d's prefix scorer restricted to the
tenant's namespace. The first rank serves; the second is the one failover retry.

`predicted_cached_tokens` is what the engine should report: whole matched blocks, capped
at the prompt less its last token (vLLM always recomputes the last prompt token).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass


class RoutingPolicy(enum.StrEnum):
    KV_AWARE = "kv_aware"
    LEAST_LOADED = "least_loaded"
    ROUND_ROBIN = "round_robin"


@dataclass(frozen=True, slots=True)
class RoutingWeights:
    overlap_weight: float = 1.0
    load_weight: float = 1.0

    def __post_init__(self) -> None:
        for name in ("overlap_weight", "load_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not (
                    0 <= value < math.inf):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class Candidate:
    """One rank that is up. `member` is the caller's index of it (0..members-1)."""

    member: int
    block_size: int
    overlap_blocks: int
    index_synced: bool
    in_flight: int
    engine_load: float | None = None
    may_grow: bool = True  # False: the rank holds nothing the prompt's later ids could match

    @property
    def load(self) -> float:
        return max(float(self.in_flight), self.engine_load or 0.0)

    @property
    def credited_blocks(self) -> int:
        return self.overlap_blocks if self.index_synced else 0


def predicted_cached_tokens(prompt_tokens: int, overlap_blocks: int, block_size: int) -> int:
    if prompt_tokens <= 1 or block_size < 1:
        return 0
    return min(overlap_blocks, (prompt_tokens - 1) // block_size) * block_size


def kv_cost(candidate: Candidate, prompt_tokens: int, weights: RoutingWeights) -> float:
    blocks = math.ceil(prompt_tokens / candidate.block_size) if prompt_tokens > 0 else 0
    prefill = max(0, blocks - candidate.credited_blocks)
    return weights.overlap_weight * prefill + weights.load_weight * candidate.load


def beats_whatever_follows(best: Candidate, candidates: Sequence[Candidate], known_tokens: int,
                           most_tokens: int, weights: RoutingWeights) -> bool:
    """Whether kv_aware puts `best` first for every prompt that starts with `known_tokens`
    known ids and has at most `most_tokens`, each candidate's overlap being that of the known
    ids' full blocks (one block size for all). A rank's overlap can grow past that only
    where it matched every known block, up to the prompt's full blocks; `best`'s growing
    only helps it. No rank is credited more blocks than the prompt has, so the prompt's
    blocks cancel out of a comparison: `best` wins whatever follows when its cost is lower
    than another's even at that one's most overlap (by more than rounding). A rank that
    cannot grow (`may_grow` False, a known block missed, or no credit) and ties `best` in
    overlap and load ties it for every prompt alike: the rotation orders the two, as it will
    on the whole prompt."""
    for other in candidates:
        if other.member == best.member:
            continue
        ceiling = most_tokens // other.block_size
        grows = other.index_synced and other.may_grow and \
            other.overlap_blocks >= known_tokens // other.block_size
        most = ceiling if grows else other.credited_blocks
        if not grows and most == best.credited_blocks and other.load == best.load:
            continue
        edge = weights.overlap_weight * (best.credited_blocks - most) + \
            weights.load_weight * (other.load - best.load)
        scale = 1 + weights.overlap_weight * ceiling + \
            weights.load_weight * (other.load + best.load)
        if edge <= 1e-9 * scale:
            return False
    return True


def rank_order(policy: RoutingPolicy, candidates: Sequence[Candidate], prompt_tokens: int,
               weights: RoutingWeights, turn: int, members: int) -> tuple[int, ...]:
    """Members best first. `turn` counts requests (round-robin position); `members` is
    how many ranks exist, up or not, so the rotation is stable while ranks go and come."""
    span = max(members, 1)

    def rotation(c: Candidate) -> int:
        return (c.member - turn) % span

    if policy is RoutingPolicy.ROUND_ROBIN:
        ordered = sorted(candidates, key=rotation)
    elif policy is RoutingPolicy.LEAST_LOADED:
        ordered = sorted(candidates, key=lambda c: (c.load, rotation(c)))
    else:
        ordered = sorted(candidates, key=lambda c: (kv_cost(c, prompt_tokens, weights), c.load,
                                                    rotation(c)))
    return tuple(c.member for c in ordered)
