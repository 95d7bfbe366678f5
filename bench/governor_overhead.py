"""The governor's overhead against calling the engine directly (docs/reference/benchmarking.md
§6-7).

Both arms hit the same upstream process from the same client: `direct` (client → engine)
and `governor` (client → fak serve → engine). Paired, interleaved rounds after a discarded
warm-up; medians of round medians with IQR, and p99:
  - added latency of small non-streaming requests,
  - added TTFT of streaming requests,
  - throughput ratio at concurrency 64 (streaming, output chunks/s).
The default upstream is bench/instant_upstream.py, so the engine does not hide the cost;
`--upstream-url` points both arms at a real engine (fak engine serve, vLLM) instead.

    .venv/bin/python bench/governor_overhead.py [--rounds 7] [--per-round 25]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
KEY = "bench-key"
MODEL = "smollm2"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout_s}s")


@contextlib.contextmanager
def process(cmd: list[str], ready_url: str) -> Iterator[None]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        wait_ready(ready_url)
        yield
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
        proc.kill()


def governor_config(directory: Path, upstream: str) -> Path:
    import hashlib

    digest = hashlib.sha256(KEY.encode()).hexdigest()
    path = directory / "fak.toml"
    path.write_text(f"""
[server]
data_dir = "{directory / 'data'}"
max_engine_concurrency = 256
admission_wait_s = 60.0

[engine]
kind = "vllm"
base_url = "{upstream}"
model = "{MODEL}"

[engine.declare]
prompt_tokens_details = true

[[tenants]]
id = "bench"
api_key_sha256 = ["{digest}"]
class = "interactive"
max_concurrency = 256
max_tokens = 2048
""")
    return path


async def one_request(client: httpx.AsyncClient, base: str, stream: bool,
                      max_tokens: int) -> float:
    """Seconds to the full answer (non-streaming) or to the first token (streaming)."""
    body = {"model": MODEL, "prompt": "Say hello in one word.", "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}
    start = time.perf_counter()
    if not stream:
        r = await client.post(base + "/v1/completions", json=body)
        r.raise_for_status()
        return time.perf_counter() - start
    first = None
    async with client.stream("POST", base + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - start
    assert first is not None
    return first


async def latency_rounds(arms: dict[str, str], stream: bool, rounds: int, per_round: int,
                         warmup: int) -> dict[str, list[list[float]]]:
    headers = {"Authorization": f"Bearer {KEY}"}
    samples: dict[str, list[list[float]]] = {a: [] for a in arms}
    async with httpx.AsyncClient(headers=headers, timeout=120) as client:
        for base in arms.values():
            for _ in range(warmup):
                await one_request(client, base, stream, 1)
        for r in range(rounds):
            order = list(arms) if r % 2 == 0 else list(reversed(arms))
            for arm in order:
                samples[arm].append([await one_request(client, arms[arm], stream, 1)
                                     for _ in range(per_round)])
    return samples


async def throughput(base: str, concurrency: int, requests: int, max_tokens: int) -> float:
    """Streamed output chunks per second with `concurrency` clients."""
    headers = {"Authorization": f"Bearer {KEY}"}
    limits = httpx.Limits(max_connections=concurrency)
    body = {"model": MODEL, "prompt": "Count.", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    chunks = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal chunks
        while not queue.empty():
            queue.get_nowait()
            async with client.stream("POST", base + "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    chunks += line.startswith("data: {")

    async with httpx.AsyncClient(headers=headers, timeout=600, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        return chunks / (time.perf_counter() - start)


def summary(rounds: list[list[float]]) -> tuple[float, float, float, float]:
    """(median of round medians, IQR low, IQR high, p99 over all) in ms."""
    medians = sorted(statistics.median(r) for r in rounds)
    q = statistics.quantiles(medians, n=4) if len(medians) > 1 else [medians[0]] * 3
    flat = sorted(x for r in rounds for x in r)
    p99 = flat[min(len(flat) - 1, int(0.99 * len(flat)))]
    return (statistics.median(medians) * 1e3, q[0] * 1e3, q[2] * 1e3, p99 * 1e3)


def report(title: str, samples: dict[str, list[list[float]]]) -> None:
    direct, gov = summary(samples["direct"]), summary(samples["governor"])
    print(f"\n{title}")
    print(f"  {'arm':10} {'p50 (median of rounds)':>24} {'IQR':>18} {'p99':>10}")
    for arm, s in (("direct", direct), ("governor", gov)):
        print(f"  {arm:10} {s[0]:21.2f} ms {s[1]:8.2f}–{s[2]:7.2f} ms {s[3]:7.2f} ms")
    paired = [(statistics.median(g) - statistics.median(d)) * 1e3
              for d, g in zip(samples["direct"], samples["governor"], strict=True)]
    print(f"  added p50: {statistics.median(paired):.2f} ms (median of paired round deltas); "
          f"added p99: {gov[3] - direct[3]:.2f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description="governor overhead vs direct")
    parser.add_argument("--upstream-url", help="an engine already running (default: start "
                        "bench/instant_upstream.py)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--per-round", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=15)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--throughput-reps", type=int, default=3)
    args = parser.parse_args()
    py = sys.executable
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        upstream = args.upstream_url
        if upstream is None:
            port = free_port()
            upstream = f"http://127.0.0.1:{port}"
            stack.enter_context(process([py, "bench/instant_upstream.py", "--port", str(port),
                                         "--chunks", str(args.max_tokens)],
                                        upstream + "/health"))
        gport = free_port()
        governor = f"http://127.0.0.1:{gport}"
        config = governor_config(Path(tmp), upstream)
        stack.enter_context(process([py, "-m", "governor.cli", "serve", "--config",
                                     str(config), "--port", str(gport), "--init-key"],
                                    governor + "/ready"))
        arms = {"direct": upstream, "governor": governor}
        print(f"upstream {upstream}; governor {governor}; {args.rounds} rounds × "
              f"{args.per_round} requests per arm, interleaved, after {args.warmup} warm-up")
        report("non-streaming, max_tokens=1 (end-to-end latency)",
               asyncio.run(latency_rounds(arms, False, args.rounds, args.per_round,
                                          args.warmup)))
        report("streaming (TTFT)",
               asyncio.run(latency_rounds(arms, True, args.rounds, args.per_round,
                                          args.warmup)))
        rates: dict[str, list[float]] = {a: [] for a in arms}
        for rep in range(args.throughput_reps):
            for arm in (list(arms) if rep % 2 == 0 else list(reversed(arms))):
                rates[arm].append(asyncio.run(throughput(arms[arm], args.concurrency,
                                                         args.requests, args.max_tokens)))
        d, g = statistics.median(rates["direct"]), statistics.median(rates["governor"])
        print(f"\nthroughput at concurrency {args.concurrency} ({args.requests} streams × "
              f"{args.max_tokens} chunks, {args.throughput_reps} interleaved reps, medians)")
        print(f"  direct {d:.0f} chunks/s; governor {g:.0f} chunks/s; ratio {g / d:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
