"""Added latency one request at a time, with idle gaps between them (issue 19).

A real engine takes tens of milliseconds per request, so at concurrency 1 the governor meets
each request after the machine has run other work: its code and data have left the caches.
This bench shows that cost against bench/instant_upstream.py: one keep-alive client sends
one non-streaming completion to each arm in turn (direct, fak, the bare aiohttp proxy, ...;
the order rotates every round), sleeping `--gap-ms` before each, and reports every arm's
median latency and the median minus direct's: the added latency with cold caches. `--gap-ms
0` gives the warm figure. Arms as in bench/line_rate.py. Run it under the bench lock:

    flock /tmp/fak-bench.lock .venv/bin/python bench/cold_latency.py [--gap-ms 50] \\
        [--rounds 150] [--arms fak,aiohttp-aiohttp] [--fak-arm base=<a worktree>]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import statistics
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import line_rate

from governor.bench.artifact import load_average, machine_line

WARMUP = 200  # back-to-back requests per arm first: connections made, code loaded


class Client:
    """One keep-alive connection to an arm, sending the line-rate bench's request."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=30)
        self.headers = {"Content-Type": "application/json",
                        "Authorization": f"Bearer {line_rate.KEY}"}

    def once(self) -> float:
        """Milliseconds from sending the request to the whole answer."""
        started = time.perf_counter()
        self.conn.request("POST", "/v1/completions", line_rate.BODY, self.headers)
        answer = self.conn.getresponse()
        answer.read()
        took = (time.perf_counter() - started) * 1e3
        if answer.status != 200:
            raise SystemExit(f"an arm answered {answer.status}")
        return took


def run(args: argparse.Namespace) -> None:
    print(f"CPU: {machine_line()}; load average at start {load_average()}")
    with tempfile.TemporaryDirectory() as tmpdir, contextlib.ExitStack() as stack:
        port = line_rate.free_port()
        upstream = f"http://127.0.0.1:{port}"
        stack.enter_context(line_rate.process(
            [sys.executable, "bench/instant_upstream.py", "--port", str(port)],
            upstream + "/health"))
        arms = line_rate.start_arms(stack, Path(tmpdir), upstream, args)
        clients = {name: Client(arm.url) for name, arm in arms.items()}
        for client in clients.values():
            for _ in range(WARMUP):
                client.once()
        took: dict[str, list[float]] = {name: [] for name in clients}
        names = list(clients)
        for i in range(args.rounds):
            shift = i % len(names)
            for name in names[shift:] + names[:shift]:
                time.sleep(args.gap_ms / 1e3)
                took[name].append(clients[name].once())
    direct = statistics.median(took["direct"])
    print(f"\none request every {args.gap_ms:g} ms, {args.rounds} rounds, arms in rotation")
    print("| arm | p50 ms | p90 ms | added p50 ms |")
    print("|---|---|---|---|")
    for name, values in took.items():
        p50 = statistics.median(values)
        p90 = statistics.quantiles(values, n=10)[-1]
        print(f"| {name} | {p50:.3f} | {p90:.3f} | {p50 - direct:+.3f} |")
    print(f"load average at the end {load_average()}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", type=lambda s: [a for a in s.split(",") if a],
                        default=["fak", "aiohttp-aiohttp"], help="comma-separated, besides "
                        "direct (bench/line_rate.py's arms)")
    parser.add_argument("--fak-arm", action="append", default=[], metavar="NAME=PATH",
                        help="fak serve from another checkout as arm NAME (repeatable)")
    parser.add_argument("--gap-ms", type=float, default=50.0,
                        help="idle time before each request (0: back to back)")
    parser.add_argument("--rounds", type=int, default=150)
    args = parser.parse_args(argv)
    args.fak_roots = dict(spec.split("=", 1) for spec in args.fak_arm)
    args.arms += [name for name in args.fak_roots if name not in args.arms]
    if args.rounds < 2:
        parser.error("--rounds must be at least 2")
    run(args)


if __name__ == "__main__":
    main()
