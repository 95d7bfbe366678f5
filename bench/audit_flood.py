"""A tenant floods the governor with salt-bearing requests: what do the others see?

Starts `fak serve` on the embedded model with two tenants. Each round the victim sends
`--victim` one-at-a-time completions alone, and as many (other prompts) while the flooder
sends its share of `--flood` requests (each carries a `cache_salt`: refused with 400 and
counted, never logged one by one); the two phases alternate their order round by round.
Prints the victim's p50 latency alone and under the flood (medians over rounds), their
ratio, the audit log's growth and the CPU flags.

    .venv/bin/python bench/audit_flood.py [--flood 10000] [--rounds 5] [--victim 12]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from governor.auth import sha256_hex
from governor.bench.artifact import load_average, machine_line

ROOT = Path(__file__).resolve().parents[1]
SERVING = re.compile(r"fak: serving on (\S+) \(metrics on (\S+)\)")


def start(data: Path, victim_key: str, flood_key: str) -> tuple[subprocess.Popen[bytes], str]:
    config = data / "fak.toml"
    config.write_text(f"""[server]
data_dir = "{data}"
client_cache_salt = "reject"

[engine]
kind = "native"

[[tenants]]
id = "victim"
api_key_sha256 = ["{sha256_hex(victim_key)}"]
class = "interactive"

[[tenants]]
id = "flood"
api_key_sha256 = ["{sha256_hex(flood_key)}"]
class = "batch"
max_concurrency = 64
max_queued = 64
""")
    log = (data / "serve.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "governor.cli", "serve", "--config",
                             str(config), "--port", "0", "--metrics-port", "0", "--init-key"],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        found = SERVING.search((data / "serve.log").read_text(errors="replace"))
        if found:
            return proc, found.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    raise SystemExit("fak serve did not start:\n" + (data / "serve.log").read_text()[-2000:])


async def victim_latencies(http: aiohttp.ClientSession, url: str, key: str, n: int,
                           tag: str) -> list[float]:
    """`n` one-at-a-time completions; `tag` makes every prompt new (no phase reuses
    another's cached prefix)."""
    out = []
    for i in range(n):
        body = {"prompt": f"{tag} request {i}: one two three", "max_tokens": 4,
                "temperature": 0, "ignore_eos": True}
        start = time.perf_counter()
        async with http.post(url + "/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as r:
            assert r.status == 200, await r.text()
            await r.read()
        out.append(time.perf_counter() - start)
    return out


async def flood(http: aiohttp.ClientSession, url: str, key: str, n: int, stop: asyncio.Event,
                concurrency: int) -> int:
    body = json.dumps({"prompt": "x", "max_tokens": 1, "cache_salt": "mine"}).encode()
    sent = 0

    async def worker() -> None:
        nonlocal sent
        while sent < n and not stop.is_set():
            sent += 1
            async with http.post(url + "/v1/completions", data=body, headers={
                    "Authorization": f"Bearer {key}", "Content-Type": "application/json",
                    "x-cache-salt": "mine"}) as r:
                await r.read()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sent


async def run(args: argparse.Namespace, url: str, victim_key: str, flood_key: str
              ) -> tuple[list[float], list[float], int]:
    alone, flooded, sent = [], [], 0
    per_round = args.flood // args.rounds
    async with aiohttp.ClientSession() as http:
        await victim_latencies(http, url, victim_key, 3, "warm-up")
        for r in range(args.rounds):
            for phase in ("alone", "flood") if r % 2 == 0 else ("flood", "alone"):
                if phase == "alone":
                    alone.append(statistics.median(await victim_latencies(
                        http, url, victim_key, args.victim, f"round {r} alone")))
                    continue
                stop = asyncio.Event()
                flooding = asyncio.create_task(flood(http, url, flood_key, per_round, stop,
                                                     args.concurrency))
                await asyncio.sleep(0.2)
                flooded.append(statistics.median(await victim_latencies(
                    http, url, victim_key, args.victim, f"round {r} flood")))
                sent += await flooding
    return alone, flooded, sent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flood", type=int, default=10_000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--victim", type=int, default=12)
    p.add_argument("--concurrency", type=int, default=8)
    args = p.parse_args()
    victim_key, flood_key = secrets.token_urlsafe(16), secrets.token_urlsafe(16)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp)
        proc, url = start(data, victim_key, flood_key)
        try:
            log = data / "audit.log"
            before = log.stat().st_size if log.exists() else 0
            alone, flooded, sent = asyncio.run(run(args, url, victim_key, flood_key))
            time.sleep(1.5)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
        lines = log.read_text().splitlines()
        kinds = [json.loads(x)["record"]["event"]["kind"] for x in lines]
        a, f = statistics.median(alone), statistics.median(flooded)
        print(f"CPU: {machine_line()}; load {load_average()}")
        print(f"flood: {sent} salt-bearing requests; victim p50 alone {a * 1000:.1f} ms, "
              f"under the flood {f * 1000:.1f} ms, ratio {f / a:.3f}")
        print(f"audit log: +{log.stat().st_size - before} bytes, {len(lines)} records: "
              f"{ {k: kinds.count(k) for k in sorted(set(kinds))} }")


if __name__ == "__main__":
    main()
