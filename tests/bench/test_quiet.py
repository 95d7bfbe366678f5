"""The wait for a quiet machine before each measured block (`governor.bench.quiet`): what
it reads, that it sees a busy machine, and that the A/B runner waits out an arm's tail of
busy CPU and refuses a pair whose blocks started on a machine that never went quiet."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from governor.bench.quiet import busy_share, cpu_jiffies, parse_cpu_line, wait_quiet

from .conftest import RunPair
from .cpu_load import busy_machine
from .fake_upstream import FakeUpstreamConfig

# The tests' own spinners fill every core (~100% busy); a CI machine installing vLLM in the
# background stays well under this.
LOUD = 0.9


def test_proc_stat_is_read_as_busy_and_total_jiffies(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 5 50 800 40 3 2 0 7 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n")
    assert cpu_jiffies(stat) == (160, 1000)  # idle 800 and iowait 40 are not busy
    assert busy_share((160, 1000), (220, 1100)) == pytest.approx(0.6)
    assert busy_share((160, 1000), (160, 1000)) == 0.0
    assert cpu_jiffies(tmp_path / "absent") is None


@given(st.one_of(st.text(max_size=300),
                 st.lists(st.integers(0, 2**64), max_size=12).map(
                     lambda xs: "cpu " + " ".join(map(str, xs)))))
def test_any_cpu_line_is_read_or_refused_without_raising(line: str) -> None:
    got = parse_cpu_line(line)
    assert got is None or (0 <= got[0] <= got[1])


async def test_a_busy_machine_is_waited_for_then_reported() -> None:
    with busy_machine():
        loud = await wait_quiet(LOUD, 1.0)
    assert loud.settled is False and loud.busy is not None and loud.busy > LOUD
    assert loud.waited_s >= 1.0
    quiet = await wait_quiet(LOUD, 10.0)
    assert quiet.settled is True and quiet.busy is not None and quiet.busy <= LOUD
    assert (await wait_quiet(LOUD, 0.0)).settled is None  # the wait turned off


async def test_blocks_start_after_the_previous_arms_tail(run_pair: RunPair) -> None:
    """Arm a's server keeps every core busy for 0.8 s after each burst, as vLLM CPU does:
    the block after each of its blocks waits that out instead of sharing the machine."""
    m = await run_pair(FakeUpstreamConfig(seed=1, cpu_tail_s=0.8), FakeUpstreamConfig(seed=2),
                       blocks=3, requests=4, concurrency=4, settle=(LOUD, 15.0))
    blocks = sorted(m.runs[0].blocks, key=lambda b: b.position)
    assert all(b.settle.settled for b in blocks)
    after_a = [b for prev, b in itertools.pairwise(blocks) if prev.arm == "a"]
    assert after_a and all(b.settle.waited_s >= 0.5 for b in after_a)
    assert "6 of 6 blocks started so" in m.reports[0].settle
    assert all("still busy" not in r for p in m.reports[0].pairs for r in p.decision.reasons)


async def test_a_machine_that_never_goes_quiet_refuses_the_pair(run_pair: RunPair) -> None:
    with busy_machine():
        m = await run_pair(FakeUpstreamConfig(seed=1), FakeUpstreamConfig(seed=2), blocks=2,
                           requests=2, concurrency=2, settle=(LOUD, 0.5))
    pair = m.reports[0].pairs[0]
    assert not pair.decision.claim_allowed
    assert any("4 block(s) started while the machine was still busy" in r
               for r in pair.decision.reasons)
    assert "0 of 4 blocks started so" in m.reports[0].settle
