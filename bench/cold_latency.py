"""Added latency one request at a time, with idle gaps between them (issue 19).

A real engine takes tens of milliseconds per request, so at concurrency 1 the governor meets
each request after the machine has run other work: its code and data have left the caches.
This bench shows that cost against bench/instant_upstream.py: one keep-alive client sends
one non-streaming completion to each arm in turn (direct, fak, the bare aiohttp proxy, ...;
the order rotates every round), sleeping `--gap-ms` before each, and reports every arm's
median latency and the median minus direct's: the added latency with cold caches. `--gap-ms
0` gives the warm figure. Arms as in bench/line_rate.py.

`--upstream-url` points the arms at an engine already running, a real vLLM (served as
`smollm2`) say: each request then carries a prompt of its own (~32 tokens, seeded), so a
prefix cache serves no arm from another's work (fak salts its requests; the bare proxy and
direct do not). The added latency's 95% interval is the paired bootstrap over blocks of 10
rounds (policies.ab_stats), and every arm's CPU time per request is read from /proc. Run it
under the bench lock:

    flock /tmp/fak-bench.lock .venv/bin/python bench/cold_latency.py [--gap-ms 50] \\
        [--rounds 150] [--arms fak,aiohttp-aiohttp] [--fak-arm base=<a worktree>] \\
        [--upstream-url http://127.0.0.1:8011]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import line_rate

from governor.bench.artifact import load_average, machine_line
from policies.ab_stats import median, paired_bootstrap_difference

WARMUP = 200  # back-to-back requests per arm first: connections made, code loaded
BLOCK_ROUNDS = 10  # rounds per bootstrap block
WORDS = ("alpha", "river", "stone", "cloud", "green", "table", "window", "orange", "music",
         "paper", "light", "forest", "silver", "engine", "bridge", "garden", "yellow", "ocean",
         "winter", "number", "planet", "castle", "doctor", "animal", "market", "summer",
         "pencil", "copper", "valley", "rocket")


def fresh_bodies(seed: int = 7) -> Callable[[], str]:
    """The line-rate bench's request, each time with a prompt of 30 seeded words."""
    rng = random.Random(seed)
    template = json.loads(line_rate.BODY)

    def body() -> str:
        return json.dumps({**template, "prompt": " ".join(rng.choices(WORDS, k=30))})

    return body


class Client:
    """One keep-alive connection to an arm, sending `body()`; reconnects once when the
    server closed it while idle (uvicorn's keep-alive ends after 5 s)."""

    def __init__(self, url: str, body: Callable[[], str]) -> None:
        parts = urlsplit(url)
        self.conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=60)
        self.body = body
        self.headers = {"Content-Type": "application/json",
                        "Authorization": f"Bearer {line_rate.KEY}"}

    def once(self) -> float:
        """Milliseconds from sending the request to the whole answer."""
        try:
            return self._once()
        except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
            self.conn.close()
            return self._once()

    def _once(self) -> float:
        body = self.body()
        started = time.perf_counter()
        self.conn.request("POST", "/v1/completions", body, self.headers)
        answer = self.conn.getresponse()
        answer.read()
        took = (time.perf_counter() - started) * 1e3
        if answer.status != 200:
            raise SystemExit(f"an arm answered {answer.status}")
        return took


def run(args: argparse.Namespace) -> None:
    print(f"CPU: {machine_line()}; load average at start {load_average()}")
    with tempfile.TemporaryDirectory() as tmpdir, contextlib.ExitStack() as stack:
        upstream = args.upstream_url
        if upstream is None:
            port = line_rate.free_port()
            upstream = f"http://127.0.0.1:{port}"
            stack.enter_context(line_rate.process(
                [sys.executable, "bench/instant_upstream.py", "--port", str(port)],
                upstream + "/health"))
        arms = line_rate.start_arms(stack, Path(tmpdir), upstream, args)
        body = fresh_bodies() if args.upstream_url else lambda: line_rate.BODY
        clients = {name: Client(arm.url, body) for name, arm in arms.items()}
        for client in clients.values():
            for _ in range(WARMUP):
                client.once()
        cpu_before = {name: line_rate.cpu_seconds(arm.pid) for name, arm in arms.items()}
        took: dict[str, list[float]] = {name: [] for name in clients}
        names = list(clients)
        for i in range(args.rounds):
            shift = i % len(names)
            for name in names[shift:] + names[:shift]:
                time.sleep(args.gap_ms / 1e3)
                took[name].append(clients[name].once())
        cpu_ms = {name: (line_rate.cpu_seconds(arm.pid) - cpu_before[name]) * 1e3 / args.rounds
                  for name, arm in arms.items() if arm.pid is not None}
    report(took, cpu_ms, args)


def report(took: dict[str, list[float]], cpu_ms: dict[str, float],
           args: argparse.Namespace) -> None:
    def blocks(values: list[float]) -> list[list[float]]:
        return [values[i:i + BLOCK_ROUNDS] for i in range(0, len(values), BLOCK_ROUNDS)]

    direct = statistics.median(took["direct"])
    print(f"\none request every {args.gap_ms:g} ms, {args.rounds} rounds, arms in rotation")
    print("| arm | p50 ms | p90 ms | added p50 ms (95% CI) | CPU ms per request |")
    print("|---|---|---|---|---|")
    for name, values in took.items():
        p50 = statistics.median(values)
        p90 = statistics.quantiles(values, n=10)[-1]
        added = ""
        if name != "direct":
            added = f"{p50 - direct:+.3f}"
            interval = paired_bootstrap_difference(blocks(took["direct"]), blocks(values),
                                                   median, random.Random(0))
            if interval is not None:
                added += f" ({interval.low:+.3f} – {interval.high:+.3f})"
        cpu = f"{cpu_ms[name]:.3f}" if name in cpu_ms else ""
        print(f"| {name} | {p50:.3f} | {p90:.3f} | {added} | {cpu} |")
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
    parser.add_argument("--upstream-url", help="an engine already running (default: start "
                        "bench/instant_upstream.py); every request then has a prompt of its own")
    args = parser.parse_args(argv)
    args.fak_roots = dict(spec.split("=", 1) for spec in args.fak_arm)
    args.arms += [name for name in args.fak_roots if name not in args.arms]
    if args.rounds < 2 * BLOCK_ROUNDS:
        parser.error(f"--rounds must be at least {2 * BLOCK_ROUNDS}")
    run(args)


if __name__ == "__main__":
    main()
