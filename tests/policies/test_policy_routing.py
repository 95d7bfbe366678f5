"""policies/routing.py: the cost formula, its invariants, and the predicted cached tokens."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.routing import (
    Candidate,
    RoutingPolicy,
    RoutingWeights,
    beats_whatever_follows,
    kv_cost,
    predicted_cached_tokens,
    rank_order,
)

W = RoutingWeights()


def cand(member: int, overlap: int = 0, synced: bool = True, in_flight: int = 0,
         load: float | None = None, block: int = 32) -> Candidate:
    return Candidate(member, block, overlap, synced, in_flight, load)


def test_kv_aware_prefers_the_cached_rank_until_its_load_outweighs_the_saving() -> None:
    prompt = 10 * 32 + 5  # 11 blocks
    cached, idle = cand(0, overlap=8), cand(1)
    assert rank_order(RoutingPolicy.KV_AWARE, [cached, idle], prompt, W, 0, 2) == (0, 1)
    assert kv_cost(cached, prompt, W) == 3 and kv_cost(idle, prompt, W) == 11
    busy = cand(0, overlap=8, in_flight=9)  # 3 + 9 > 11
    assert rank_order(RoutingPolicy.KV_AWARE, [busy, idle], prompt, W, 0, 2) == (1, 0)
    assert rank_order(RoutingPolicy.KV_AWARE, [cand(0, overlap=8, load=9.0), idle], prompt,
                      W, 0, 2) == (1, 0)  # the scraped load counts too


def test_an_unsynced_index_earns_no_overlap_credit() -> None:
    prompt = 10 * 32 + 5
    stale = cand(0, overlap=10, synced=False)
    assert kv_cost(stale, prompt, W) == 11
    assert rank_order(RoutingPolicy.KV_AWARE, [stale, cand(1, overlap=1)], prompt, W, 0,
                      2) == (1, 0)


def test_round_robin_and_least_loaded() -> None:
    members = [cand(0), cand(1, in_flight=2), cand(2)]
    assert [rank_order(RoutingPolicy.ROUND_ROBIN, members, 0, W, t, 3)[0]
            for t in range(4)] == [0, 1, 2, 0]
    assert rank_order(RoutingPolicy.LEAST_LOADED, members, 0, W, 1, 3) == (2, 0, 1)
    # A member that is down is simply absent; the rotation stays stable.
    assert [rank_order(RoutingPolicy.ROUND_ROBIN, [members[0], members[2]], 0, W, t, 3)[0]
            for t in range(3)] == [0, 2, 2]


def test_predicted_tokens_are_whole_blocks_short_of_the_last_token() -> None:
    assert predicted_cached_tokens(97, 3, 32) == 96
    assert predicted_cached_tokens(96, 3, 32) == 64  # the last token is always recomputed
    assert predicted_cached_tokens(200, 2, 32) == 64
    assert predicted_cached_tokens(1, 5, 32) == 0


def test_weights_are_checked() -> None:
    with pytest.raises(ValueError, match="overlap_weight"):
        RoutingWeights(overlap_weight=-1)
    with pytest.raises(ValueError, match="load_weight"):
        RoutingWeights(load_weight=float("inf"))


candidates = st.lists(st.builds(cand, st.integers(0, 7), st.integers(0, 40), st.booleans(),
                                st.integers(0, 20)), min_size=1, max_size=8,
                      unique_by=lambda c: c.member)


@given(candidates, st.integers(0, 2000), st.integers(0, 100),
       st.sampled_from(list(RoutingPolicy)))
def test_every_policy_orders_exactly_the_candidates(cs, prompt, turn, policy) -> None:
    order = rank_order(policy, cs, prompt, W, turn, 8)
    assert sorted(order) == sorted(c.member for c in cs)


@given(candidates, st.integers(1, 2000), st.integers(0, 100))
def test_kv_aware_first_choice_has_the_lowest_cost(cs, prompt, turn) -> None:
    first = rank_order(RoutingPolicy.KV_AWARE, cs, prompt, W, turn, 8)[0]
    costs = {c.member: kv_cost(c, prompt, W) for c in cs}
    assert costs[first] == min(costs.values())


def test_a_rank_holding_the_known_blocks_wins_early_unless_another_could_catch_up() -> None:
    """Known: 4 blocks of 32 (128 ids), at most 100 more follow (7 blocks in all)."""
    cached, idle = cand(0, overlap=4), cand(1, overlap=1)
    assert beats_whatever_follows(cached, [cached, idle], 128, 228, W)
    # Another rank holding every known block may hold the rest too.
    assert not beats_whatever_follows(cached, [cached, cand(1, overlap=4)], 128, 228, W)
    # Its load can still decide it: 3 more blocks at most against 4 more requests, not 2.
    assert beats_whatever_follows(cached, [cached, cand(1, overlap=4, in_flight=4)], 128, 228,
                                  W)
    assert not beats_whatever_follows(cached, [cached, cand(1, overlap=4, in_flight=2)], 128,
                                      228, W)
    # An unsynced index earns nothing, whatever it holds.
    assert beats_whatever_follows(cand(0, overlap=2), [cand(0, overlap=2),
                                                       cand(1, overlap=4, synced=False)],
                                  128, 228, W)
    # A tie with a rank that cannot grow (it missed a known block) is a tie on the whole
    # prompt too, which the rotation settles alike; a tie with one that may grow is not.
    assert beats_whatever_follows(idle, [idle, cand(2, overlap=1)], 128, 228, W)
    assert not beats_whatever_follows(cand(0, overlap=4), [cand(0, overlap=4),
                                                           cand(1, overlap=4)], 128, 228, W)


def test_with_no_known_ids_only_ranks_holding_nothing_of_the_namespace_decide_early() -> None:
    """Nothing known (a text the tenant never sent): a rank holding any of the namespace
    could match the whole prompt; ranks holding none of it are exact at no overlap."""
    empty = [cand(0, in_flight=1), cand(1, in_flight=3), cand(2, in_flight=1)]
    empty = [Candidate(c.member, 32, 0, True, c.in_flight, None, may_grow=False)
             for c in empty]
    assert beats_whatever_follows(empty[0], empty, 0, 500, W)  # member 2 ties: rotation
    holding = [empty[0], empty[1], cand(2, in_flight=1)]
    assert not beats_whatever_follows(empty[0], holding, 0, 500, W)
    # A rank that may grow but is far busier cannot catch up within the prompt's blocks.
    assert beats_whatever_follows(empty[0], [empty[0], cand(1, in_flight=40)], 0, 500, W)


@given(st.data(), st.integers(1, 32), st.integers(0, 300), st.integers(0, 100),
       st.integers(0, 100), st.floats(0, 3), st.floats(0, 3))
def test_an_early_winner_is_first_for_every_prompt_the_known_ids_allow(
        data, block, known, more, turn, overlap_weight, load_weight) -> None:
    """`beats_whatever_follows` against the decision on the whole prompt: whatever the
    prompt's length and each rank's overlap past the known blocks, the early winner is first."""
    weights, full = RoutingWeights(overlap_weight, load_weight), known // block
    cs = data.draw(st.lists(st.builds(Candidate, st.integers(0, 7), st.just(block),
                                      st.integers(0, full), st.booleans(), st.integers(0, 4),
                                      st.none(), st.booleans()),
                            min_size=1, max_size=8, unique_by=lambda c: c.member))
    best = next(c for c in cs if c.member == rank_order(RoutingPolicy.KV_AWARE, cs, known + 1,
                                                        weights, turn, 8)[0])
    if not beats_whatever_follows(best, cs, known, known + more, weights):
        return
    prompt = data.draw(st.integers(known + (more > 0), known + more))
    whole = [c if c.overlap_blocks < full or not c.may_grow else Candidate(
        c.member, block, data.draw(st.integers(full, prompt // block)), c.index_synced,
        c.in_flight) for c in cs]
    assert rank_order(RoutingPolicy.KV_AWARE, whole, prompt, weights, turn, 8)[0] == best.member
