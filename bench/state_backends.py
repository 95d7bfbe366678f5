"""What shared state costs a request: the governor's added latency with `[state] backend =
"postgres"` against `"file"`, side by side (issue 15; docs/reference/benchmarking.md §6-7).

Three arms hit one near-instant upstream (bench/instant_upstream.py) from one client:
`direct`, `file` (fak serve, file backend) and `postgres` (fak serve, postgres backend on a
throwaway local PostgreSQL, or `--dsn-env VAR`). Paired, interleaved rounds after a
discarded warm-up; added p50 = median over rounds of (arm's round median − direct's).
Then the database's committed transactions are counted over the postgres arm's requests
and over an idle window as long: equal rates show epoch reads never reach the database on
the request path (only the watcher's polls do).

    flock /tmp/fak-bench.lock .venv/bin/python bench/state_backends.py [--rounds 9]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import pwd
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from line_rate import (  # a sibling script, found through the path above
    BODY,
    KEY,
    free_port,
    governor_config,
    process,
)

from governor.bench.artifact import load_average, machine_line

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def throwaway_postgres() -> Iterator[str]:
    """initdb + pg_ctl in a temp dir on a free port (as `postgres` when run as root)."""
    tool_dir = Path(shutil.which("pg_ctl") or
                    sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))[-1]).parent
    root = Path(tempfile.mkdtemp(prefix="fak-bench-pg-"))
    prefix: list[str] = []
    if os.geteuid() == 0:
        user = pwd.getpwnam("postgres")
        os.chown(root, user.pw_uid, user.pw_gid)
        prefix = ["runuser", "-u", "postgres", "--"]
    port = free_port()

    def run(*cmd: str) -> None:
        subprocess.run([*prefix, *cmd], check=True, capture_output=True, timeout=120)

    run(str(tool_dir / "initdb"), "-D", str(root / "data"), "-U", "fak", "--auth=trust")
    run(str(tool_dir / "pg_ctl"), "-D", str(root / "data"), "-l", str(root / "log"), "-o",
        f"-c listen_addresses=127.0.0.1 -p {port} -c unix_socket_directories={root}",
        "-w", "start")
    try:
        yield f"postgresql://fak@127.0.0.1:{port}/postgres"
    finally:
        run(str(tool_dir / "pg_ctl"), "-D", str(root / "data"), "-m", "fast", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)


def postgres_config(directory: Path, upstream: str) -> Path:
    """The postgres backend on the database in $FAK_STATE_DSN."""
    return governor_config(directory, upstream, shared=True)


async def one_request(client: httpx.AsyncClient, base: str) -> float:
    """Seconds to the whole answer of one non-streaming one-token completion."""
    start = time.perf_counter()
    r = await client.post(base + "/v1/completions", content=BODY,
                          headers={"Content-Type": "application/json"})
    r.raise_for_status()
    return time.perf_counter() - start


async def latency_rounds(arms: dict[str, str], rounds: int, per_round: int,
                         warmup: int) -> dict[str, list[list[float]]]:
    """Each arm's request latencies per round; the arms' order alternates round by round."""
    samples: dict[str, list[list[float]]] = {a: [] for a in arms}
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"},
                                 timeout=120) as client:
        for base in arms.values():
            for _ in range(warmup):
                await one_request(client, base)
        for r in range(rounds):
            for arm in (list(arms) if r % 2 == 0 else list(reversed(arms))):
                samples[arm].append([await one_request(client, arms[arm])
                                     for _ in range(per_round)])
    return samples


def committed(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute("SELECT xact_commit FROM pg_stat_database "
                           "WHERE datname = current_database()").fetchone()
    assert row is not None
    return int(row[0])


async def timed_requests(base: str, count: int) -> float:
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"},
                                 timeout=60) as client:
        start = time.perf_counter()
        for _ in range(count):
            await one_request(client, base)
        return time.perf_counter() - start


def database_rates(dsn: str, base: str, count: int) -> tuple[float, float, float]:
    """(transactions/s while `count` requests run, transactions/s idle as long, req/s)."""
    time.sleep(1.0)  # statistics are reported with a delay; let them settle
    before = committed(dsn)
    busy_s = asyncio.run(timed_requests(base, count))
    time.sleep(0.6)
    busy = committed(dsn) - before
    time.sleep(0.6)
    before = committed(dsn)
    time.sleep(busy_s)
    time.sleep(0.6)
    idle = committed(dsn) - before
    return busy / (busy_s + 0.6), idle / (busy_s + 0.6), count / busy_s


def report(samples: dict[str, list[list[float]]]) -> dict[str, float]:
    added = {}
    print(f"  {'arm':10} {'p50 (median of rounds)':>24} {'added p50':>12} {'p99':>10}")
    direct = samples["direct"]
    for arm, rounds in samples.items():
        p50 = statistics.median(statistics.median(r) for r in rounds) * 1e3
        flat = sorted(x for r in rounds for x in r)
        p99 = flat[min(len(flat) - 1, int(0.99 * len(flat)))] * 1e3
        deltas = [(statistics.median(a) - statistics.median(d)) * 1e3
                  for a, d in zip(rounds, direct, strict=True)]
        added[arm] = statistics.median(deltas)
        print(f"  {arm:10} {p50:21.3f} ms {added[arm]:9.3f} ms {p99:7.2f} ms")
    return added


def main() -> int:
    parser = argparse.ArgumentParser(description="added latency: postgres vs file backend")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--per-round", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--dsn-env", help="an existing database (default: a throwaway one)")
    args = parser.parse_args()
    py = sys.executable
    print(f"CPU: {machine_line()}; load {load_average()}")
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        dsn = os.environ[args.dsn_env] if args.dsn_env else stack.enter_context(
            throwaway_postgres())
        os.environ["FAK_STATE_DSN"] = dsn
        port = free_port()
        upstream = f"http://127.0.0.1:{port}"
        stack.enter_context(process([py, "bench/instant_upstream.py", "--port", str(port)],
                                    upstream + "/health"))
        arms = {"direct": upstream}
        for arm, make in (("file", governor_config), ("postgres", postgres_config)):
            directory = Path(tmp) / arm
            directory.mkdir()
            gport = free_port()
            arms[arm] = f"http://127.0.0.1:{gport}"
            stack.enter_context(process([py, "-m", "governor.cli", "serve", "--config",
                                         str(make(directory, upstream)), "--port", str(gport),
                                         "--init-key"], arms[arm] + "/ready"))
        print(f"{args.rounds} rounds × {args.per_round} non-streaming max_tokens=1 requests "
              f"per arm, interleaved (order alternates), after {args.warmup} warm-up")
        added = report(asyncio.run(latency_rounds(arms, args.rounds, args.per_round,
                                                  args.warmup)))
        print(f"  postgres − file: {added['postgres'] - added['file']:+.3f} ms added p50 "
              f"(target ≤ +0.5 ms)")
        busy, idle, rate = database_rates(dsn, arms["postgres"], 400)
        print(f"database commits: {busy:.1f}/s while the postgres arm served {rate:.0f} "
              f"requests/s, {idle:.1f}/s idle — {(busy - idle) / rate:+.3f} per request "
              f"(the watcher's polls only)")
    print(f"load at the end {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
