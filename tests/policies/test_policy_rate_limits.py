"""Token-bucket arithmetic (policies.rate_limits): nothing is ever granted beyond
`capacity + rate × elapsed`, a refusal's wait is exactly when the token is there, and debt
refills at the bucket's rate."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.rate_limits import Bucket, requests_bucket, tokens_bucket

RATES = st.floats(0.01, 1000.0)
STEPS = st.lists(st.floats(0.0, 5.0), min_size=1, max_size=200)  # time between attempts
EPS = 1e-6


def slack(bucket: Bucket) -> float:
    return EPS * max(1.0, bucket.capacity)


@given(rate=RATES, capacity=st.floats(1.0, 1000.0), start=st.floats(0.0, 1e6), steps=STEPS,
       amount=st.floats(0.1, 5.0))
def test_grants_never_exceed_capacity_plus_rate_times_time(rate: float, capacity: float,
                                                           start: float, steps: list[float],
                                                           amount: float) -> None:
    bucket = Bucket.full(rate, capacity, start)
    now, granted = start, 0.0
    for dt in steps:
        now += dt
        bucket, wait = bucket.take(now, amount)
        if wait == 0.0:
            granted += amount
        assert granted <= capacity + rate * (now - start) + slack(bucket)
        assert bucket.level <= capacity and bucket.at == now


@given(rate=RATES, capacity=st.floats(1.0, 100.0), burst=st.integers(1, 300),
       dt=st.floats(0.0, 2.0))
def test_a_refusals_wait_is_when_the_token_is_there(rate: float, capacity: float,
                                                    burst: int, dt: float) -> None:
    """The wait a refusal names (what Retry-After is made of) is exact: the same take a
    hair earlier still fails, at the named time it succeeds."""
    bucket = Bucket.full(rate, capacity, 0.0)
    now = 0.0
    for _ in range(burst):
        bucket, _ = bucket.take(now)
        now += dt / burst
    refused, wait = bucket.take(now)
    if wait == 0.0:
        return
    assert wait == pytest.approx((1.0 - refused.level) / rate)
    _, wait_then = refused.take(now + wait * (1 + 1e-9) + 1e-12)
    assert wait_then == 0.0
    if wait > 1e-3:  # a wait far above the clock's resolution at `now`
        _, still = refused.take(now + wait * 0.999)
        assert still > 0.0


@given(rate=RATES, capacity=st.floats(1.0, 1e5), start=st.floats(0.0, 1e6),
       work=st.lists(st.tuples(st.floats(0.0, 10.0), st.floats(0.0, 10.0),
                               st.integers(0, 5000)), min_size=1, max_size=100))
def test_debits_never_let_a_request_in_beyond_the_rate(
        rate: float, capacity: float, start: float,
        work: list[tuple[float, float, int]]) -> None:
    """Admission as the governor does it: a request is let in only while the level is
    positive, and its tokens are debited when it ends (`delay` later). At every admission,
    the tokens already debited are below capacity + rate × elapsed."""
    bucket = Bucket.full(rate, capacity, start)
    now, debited = start, 0.0
    pending: list[tuple[float, int]] = []  # (end time, tokens) of requests let in
    for gap, delay, tokens in work:
        now += gap
        for end, charge in sorted(p for p in pending if p[0] <= now):
            bucket = bucket.debit(end, charge)
            debited += charge
        pending = [p for p in pending if p[0] > now]
        if bucket.wait_until_positive(now) == 0.0:
            assert debited < capacity + rate * (now - start) + slack(bucket)
            pending.append((now + delay, tokens))


@given(rate=RATES, capacity=st.floats(1.0, 1e5), debt=st.floats(0.0, 1e5),
       now=st.floats(0.0, 1e6))
def test_debt_refills_at_the_rate(rate: float, capacity: float, debt: float,
                                  now: float) -> None:
    bucket = Bucket.full(rate, capacity, now).debit(now, capacity + debt)
    assert bucket.level == pytest.approx(-debt, abs=slack(bucket))
    wait = bucket.wait_until_positive(now)
    assert wait == pytest.approx(debt / rate, rel=1e-6, abs=1e-6)
    assert bucket.wait_until_positive(now + wait * (1 + 1e-9) + 1e-9) == 0.0
    if wait > 1e-3:  # a wait far above the clock's resolution at `now`
        assert bucket.wait_until_positive(now + wait * 0.999) > 0.0
    refilled = bucket.refilled(now + wait + (capacity + debt) / rate + 1.0)
    assert refilled.level == capacity  # refills to capacity, never past it


@given(rate=RATES, capacity=st.floats(1.0, 100.0), back=st.floats(0.0, 100.0))
def test_a_clock_going_back_mints_nothing(rate: float, capacity: float, back: float) -> None:
    bucket, _ = Bucket.full(rate, capacity, 100.0).take(100.0, capacity)
    earlier = bucket.refilled(100.0 - back)
    assert earlier.level == bucket.level == 0.0 and earlier.at == 100.0


@pytest.mark.parametrize(("rate", "capacity"), [(0.0, 1.0), (-1.0, 1.0), (math.nan, 1.0),
                                                (math.inf, 1.0), (1.0, 0.0), (1.0, math.inf)])
def test_bad_buckets_are_refused(rate: float, capacity: float) -> None:
    with pytest.raises(ValueError):
        Bucket.full(rate, capacity, 0.0)


def test_tenant_buckets() -> None:
    slow = requests_bucket(0.5, 3.0)
    assert (slow.rate, slow.capacity, slow.level, slow.at) == (0.5, 1.0, 1.0, 3.0)
    assert requests_bucket(20.0, 0.0).capacity == 20.0  # one second's burst
    tokens = tokens_bucket(600, 0.0)
    assert (tokens.rate, tokens.capacity) == (10.0, 600.0)
