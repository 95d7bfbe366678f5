"""One tenant cannot fill the audit log (issue 13, finding 4): 10,000 salt-bearing requests
against a real `fak serve` (native engine, the real model) grow the log by rate-bounded
summary records only, whose counts add up to every request."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
from pathlib import Path

import aiohttp
import pytest

from governor.audit.cli import cmd_audit_verify
from governor.audit.counters import SUMMARY_KIND
from governor.auth import sha256_hex
from schemas.audit import AuditRecord

from .audit_rig import ADMIN
from .fak_serve_process import start_fak_serve, stop_fak_serve

pytestmark = pytest.mark.slow
FLOOD, CALM = "flood", "calm"
REQUESTS, WITH_HEADER, INTERVAL_S = 10_000, 1_000, 1.0


def write_config(path: Path, data_dir: Path) -> None:
    tenants = "".join(f'[[tenants]]\nid = "{t}"\napi_key_sha256 = ["{sha256_hex("key-" + t)}"]\n'
                      for t in (FLOOD, CALM))
    path.write_text(f"""[server]
host = "127.0.0.1"
data_dir = "{data_dir}"
admin_token_sha256 = "{sha256_hex(ADMIN)}"
client_cache_salt = "reject"

[engine]
kind = "native"
max_model_len = 512
num_blocks = 128

[audit]
summary_interval_s = {INTERVAL_S}

{tenants}""")


async def flood(url: str) -> tuple[dict[int, int], int]:
    """The flood tenant's salt-bearing requests (a tenth also with namespace headers), and
    one calm-tenant completion per 1,000; status counts and calm successes."""
    statuses: dict[int, int] = {}
    calm_ok = 0
    body = {"prompt": "hi", "max_tokens": 1, "cache_salt": "mine-now"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=16)) as http:
        async def one(n: int) -> None:
            headers = {"Authorization": f"Bearer key-{FLOOD}"}
            if n < WITH_HEADER:
                headers |= {"x-tenant-id": CALM, "x-cache-salt": "theirs"}
            async with http.post(url + "/v1/completions", json=body, headers=headers) as r:
                statuses[r.status] = statuses.get(r.status, 0) + 1

        async def calm() -> None:
            nonlocal calm_ok
            async with http.post(url + "/v1/completions",
                                 json={"prompt": "Hello", "max_tokens": 1},
                                 headers={"Authorization": f"Bearer key-{CALM}"}) as r:
                calm_ok += r.status == 200

        for start in range(0, REQUESTS, 1000):
            await asyncio.gather(calm(), *(one(n) for n in range(start, start + 1000)))
    return statuses, calm_ok


def test_10k_salt_bearing_requests_grow_the_log_by_summaries_only(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    write_config(tmp_path / "fak.toml", data_dir)
    # Both ports at 0, read back from its output: a port picked free beforehand (and its
    # port + 1 for metrics) could be taken while the model loads.
    served = start_fak_serve(tmp_path / "fak.toml", data_dir)
    try:
        started = time.monotonic()
        statuses, calm_ok = asyncio.run(flood(served.url))
        elapsed = time.monotonic() - started
    finally:
        stop_fak_serve(served, grace_s=60)
    assert served.process.returncode == 0, served.log()[-4000:]
    assert statuses == {400: REQUESTS}  # every one refused, none unaudited
    assert calm_ok == REQUESTS // 1000
    log_path = data_dir / "audit.log"
    assert cmd_audit_verify(log_path) == 0
    records = [AuditRecord.from_dict(json.loads(line)["record"])
               for line in log_path.read_bytes().split(b"\n")[:-1]]
    assert {r.event.kind for r in records} == {SUMMARY_KIND}
    assert {r.event.tenant for r in records} == {FLOOD}
    totals: dict[str, int] = {}
    for r in records:
        for reason in r.event.reasons:
            name, _, value = reason.partition("=")
            totals[name] = totals.get(name, 0) + int(value) * (name != "window_ms")
    assert totals["client_salt_rejected"] == REQUESTS
    assert totals["client_header_dropped"] == WITH_HEADER
    # At most one summary per interval (the last one is the shutdown flush).
    assert len(records) <= math.ceil(elapsed / INTERVAL_S) + 2, (len(records), elapsed)
    gaps = [b.time_ms - a.time_ms for a, b in itertools.pairwise(records[:-1])]
    assert all(gap >= INTERVAL_S * 1000 - 50 for gap in gaps), gaps
    print(f"\n{REQUESTS} requests in {elapsed:.1f} s -> {len(records)} audit records "
          f"({log_path.stat().st_size} bytes)")
