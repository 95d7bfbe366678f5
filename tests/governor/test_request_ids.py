from __future__ import annotations

import re

from governor.request_ids import BATCH, RequestIds


def test_ids_are_128_random_bits_and_unique_across_batches() -> None:
    ids = RequestIds()
    seen = [ids.next() for _ in range(3 * BATCH + 7)]  # past several refills
    assert all(re.fullmatch(r"fak-[0-9a-f]{32}", i) for i in seen)
    assert len(set(seen)) == len(seen)
    assert len({i[4:] for i in seen}) == len(seen)


def test_two_sources_do_not_repeat_each_other() -> None:
    a, b = RequestIds(), RequestIds()
    assert not {a.next() for _ in range(BATCH)} & {b.next() for _ in range(BATCH)}
