"""KV-aware routing against round robin, side by side in one run (issue 14).

Two arms, each a real governor (in this process, on loopback) over its own fleet of two
`fak engine serve` replicas (separate processes, identical: the embedded SmolLM2, blocks of
`--block-size` tokens, `--num-blocks` per replica, KV events with replay, prompt-token
details). Arm `kv_aware` routes by policies.routing's cost (its shadow indexes, the
tenant's namespace, load); arm `round_robin` rotates. The arms share nothing but the CPU.

Workload: 8 tenants × 4 shared system prompts (`--system-tokens` random letters, about one
token each) × random suffixes (`--suffix-tokens`), as streaming `/v1/completions` with
`max_tokens` 4. Every (tenant, prompt) pair is asked `--repeats` times, in one shuffled
order that both arms follow, one request at a time, the arms interleaved (A, B, then B, A
for the next item). Per arm: the cached-token ratio (Σ cached_tokens / Σ prompt_tokens,
from the responses' usage), TTFT p50 (send → first streamed chunk with a choice) and, for
kv_aware, the routing decision's cost (the fleet's own timing of `decide()`: tokenising the
prompt unless the decision is early, matching every rank's index, the cost formula) twice:
in the run, where each decision follows the engines' work for the last request (which
displaces the governor's working set), and back to back after it on the same fleet and
caches (`--steady-decisions` fresh suffixes), the cost while the governor is busy. Early
decisions (taken before the prompt's new part is tokenised) are counted, and their
settling (tokenising the rest once the request is sent) is timed apart. `--pin` puts the
governors on the first CPU and the replicas on the others.

The pool is the deciding parameter: round robin puts every pair's prefix on both replicas,
kv_aware keeps each on one, so with pools smaller than the whole working set round robin
evicts what kv_aware keeps. The printed figures say which sizes they ran with.

Warm state (policies.measurement): each replica gets a discarded warm-up request; then
`--calibration` fresh-prompt requests per arm (all misses, same shape) give the first and
steady-state latencies the gate compares; replica logs are checked for request-time
compilation. Run it under the shared lock:

    flock /tmp/fak-bench.lock .venv/bin/python bench/fleet_routing.py
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import os
import random
import re
import signal
import socket
import statistics
import string
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from adapters.fleet.driver import FleetDriver  # noqa: E402
from governor.auth import sha256_hex  # noqa: E402
from governor.bench.artifact import cpu_flags, cpu_model  # noqa: E402
from governor.config import parse_config  # noqa: E402
from governor.http.server import GovernorServer  # noqa: E402
from governor.serve import build_driver, build_governor, governor_salt_key  # noqa: E402
from governor.state import Governor  # noqa: E402
from policies.measurement import ArmWarmState, gate_comparison  # noqa: E402
from schemas.bench import CompileCacheState, PrefixCacheStart, WarmState  # noqa: E402

TENANTS = tuple(f"tenant-{i}" for i in range(8))
PROMPTS = 4
POLICIES = ("kv_aware", "round_robin")
COMPILE_LOG_LINE = re.compile(rb"(?i)\bcompiling\b|aot compiled function")


@dataclass
class Replica:
    url: str
    kv_port: int
    replay_port: int
    log: Path
    process: subprocess.Popen[bytes] = field(repr=False)

    def compiled(self) -> bool:
        return bool(COMPILE_LOG_LINE.search(self.log.read_bytes()))


@dataclass
class Arm:
    policy: str
    gov: Governor
    server: GovernorServer
    replicas: list[Replica]
    ttft: list[float] = field(default_factory=list)
    cached: int = 0
    prompt: int = 0
    hits: int = 0
    calibration: list[float] = field(default_factory=list)

    @property
    def fleet(self) -> FleetDriver:
        assert isinstance(self.gov.driver, FleetDriver)
        return self.gov.driver


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def start_replica(args: argparse.Namespace, logs: Path) -> Replica:
    http, kv, replay = free_ports(3)
    events = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{kv}",
              "replay_endpoint": f"tcp://*:{replay}", "topic": "kv"}
    log = logs / f"replica-{http}.log"
    cmd = [sys.executable, "-m", "native_engine.serve.server", "--port", str(http),
           "--served-model-name", "smollm2", "--block-size", str(args.block_size),
           "--num-gpu-blocks-override", str(args.num_blocks), "--max-model-len",
           str(args.max_model_len), "--enable-prompt-tokens-details",
           "--kv-events-config", json.dumps(events)]
    if args.engine_cpus:
        cmd = ["taskset", "-c", ",".join(map(str, args.engine_cpus)), *cmd]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)
    replica = Replica(f"http://127.0.0.1:{http}", kv, replay, log, proc)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"replica exited: {log.read_text()[-2000:]}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(replica.url + "/health", timeout=5).status_code == 200:
                return replica
        time.sleep(0.5)
    raise RuntimeError("replica did not become healthy")


@contextlib.contextmanager
def replicas(args: argparse.Namespace, logs: Path) -> Iterator[list[Replica]]:
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        started = list(pool.map(lambda _: start_replica(args, logs), range(4)))
    try:
        yield started
    finally:
        for replica in started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(replica.process.pid, signal.SIGTERM)
        for replica in started:
            replica.process.wait(30)


def arm_config(policy: str, fleet: list[Replica], data_dir: Path) -> dict[str, Any]:
    upstreams = [{"name": f"replica-{i}", "base_url": r.url,
                  "kv_events": f"tcp://*:{r.kv_port}", "kv_topic": "kv",
                  "kv_replay": f"tcp://127.0.0.1:{r.replay_port}",
                  "declare": {"prompt_tokens_details": True}} for i, r in enumerate(fleet)]
    return {"server": {"data_dir": str(data_dir), "max_engine_concurrency": 8},
            "engine": {"kind": "vllm", "model": "smollm2", "upstreams": upstreams,
                       "routing": {"policy": policy, "tokenizer": "embedded"}},
            "tenants": [{"id": t, "api_key_sha256": [sha256_hex(f"key-{t}")]}
                        for t in TENANTS]}


async def start_arm(policy: str, fleet: list[Replica], data_dir: Path) -> Arm:
    config = parse_config(arm_config(policy, fleet, data_dir))
    key = governor_salt_key(config, create_key=True)
    driver = build_driver(config, key)
    await driver.start()
    gov = build_governor(config, driver, create_key=False, key=key)
    server = GovernorServer(gov)
    await server.start("127.0.0.1", 0, "127.0.0.1", 0)
    return Arm(policy, gov, server, fleet)


def letters(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(string.ascii_lowercase) for _ in range(count))


async def stream(client: httpx.AsyncClient, url: str, tenant: str,
                 prompt: str) -> tuple[float, int, int]:
    """(TTFT s, cached tokens, prompt tokens) of one streamed completion."""
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft = None
    usage: dict[str, Any] = {}
    async with client.stream("POST", url + "/v1/completions", json=body,
                             headers={"Authorization": f"Bearer key-{tenant}"}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - start
            usage = chunk.get("usage") or usage
    assert ttft is not None, "no chunk with a choice"
    details = usage.get("prompt_tokens_details") or {}
    return ttft, int(details.get("cached_tokens") or 0), int(usage["prompt_tokens"])


async def run(args: argparse.Namespace, fleet: list[Replica], data_dir: Path) -> dict:
    arms = [await start_arm(p, fleet[2 * i:2 * i + 2], data_dir / p)
            for i, p in enumerate(POLICIES)]
    rng = random.Random(args.seed)
    systems = [letters(rng, args.system_tokens) for _ in range(PROMPTS)]
    items = [(t, p) for t in TENANTS for p in range(PROMPTS)] * args.repeats
    rng.shuffle(items)
    async with httpx.AsyncClient(timeout=600) as client:
        for replica in fleet:  # discarded warm-up of each engine
            r = await client.post(replica.url + "/v1/completions", json={
                "prompt": letters(rng, 64), "max_tokens": 4, "cache_salt": "bench-warm-up"})
            r.raise_for_status()
        for _ in range(args.calibration):  # fresh prompts: misses of the same shape
            prompt = letters(rng, args.system_tokens + args.suffix_tokens)
            for arm in arms:
                arm.calibration.append((await stream(client, arm.server.url, TENANTS[0],
                                                     prompt + " " + arm.policy))[0])
        for n, (tenant, p) in enumerate(items):
            prompt = systems[p] + " " + letters(rng, args.suffix_tokens)
            for arm in arms if n % 2 == 0 else arms[::-1]:
                ttft, cached, prompt_tokens = await stream(client, arm.server.url, tenant,
                                                           prompt)
                arm.ttft.append(ttft)
                arm.cached += cached
                arm.prompt += prompt_tokens
                arm.hits += cached > 0
    routed = arms[0].fleet
    in_situ = (list(routed.decision_seconds), list(routed.tokenize_seconds),
               list(routed.decision_cpu_seconds), list(routed.settle_seconds),
               routed.early_decisions)
    steady = steady_decisions(arms[0], systems, rng, args)
    try:
        return summarise(args, arms, len(items), in_situ, steady)
    finally:
        for arm in arms:
            await arm.server.stop()
            await arm.gov.driver.close()
            arm.gov.audit.close()


def steady_decisions(arm: Arm, systems: list[str], rng: random.Random,
                     args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """`--steady-decisions` routing decisions back to back on the kv_aware fleet as the run
    left it (its shadow indexes, each tenant's token-prefix cache), each for a fresh suffix
    prepared by the governor's own path: the decision's cost while the governor is busy,
    with no other work between decisions (in the run, the engines' work for each request
    displaces the tokenizer's and the index's working set before the next decision). Each
    decision is settled at once; its time with settling is the second list."""
    times, settled = [], []
    for i in range(args.steady_decisions):
        tenant = arm.gov.config.tenant(TENANTS[i % len(TENANTS)])
        assert tenant is not None
        body = {"prompt": systems[i % PROMPTS] + " " + letters(rng, args.suffix_tokens),
                "max_tokens": 4, "temperature": 0, "stream": True}
        prepared = arm.gov.prepare_raw(tenant, "completions", json.dumps(body).encode(),
                                       f"steady-{i}")
        start = time.perf_counter()
        decision = arm.fleet.decide(prepared.request)
        times.append(time.perf_counter() - start)
        decision.settle()
        settled.append(time.perf_counter() - start)
    return times, settled


def summarise(args: argparse.Namespace, arms: list[Arm], requests: int,
              in_situ: tuple[list[float], list[float], list[float], list[float], int],
              steady: tuple[list[float], list[float]]) -> dict:
    per_arm: dict[str, dict[str, Any]] = {}
    states = []
    for arm in arms:
        per_arm[arm.policy] = {
            "requests": requests, "cached_token_ratio": arm.cached / arm.prompt,
            "hit_requests": arm.hits, "ttft_p50_s": statistics.median(arm.ttft),
            "ttft_p90_s": statistics.quantiles(arm.ttft, n=10)[-1],
            "routing": arm.fleet.routing_view(),
            "decisions_per_upstream": {u["name"]: [m["decisions"] for m in u["ranks"]]
                                       for u in arm.fleet.upstream_views()}}
        states.append(ArmWarmState(arm.policy, WarmState(
            warmup_done=True, compile_cache=CompileCacheState.NOT_APPLICABLE,
            request_time_compilation=any(r.compiled() for r in arm.replicas),
            prefix_cache_at_start=PrefixCacheStart.FLUSHED,
            first_request_latency_s=arm.calibration[0],
            steady_state_latency_s=statistics.median(arm.calibration[1:]))))
    kv, rr = per_arm["kv_aware"], per_arm["round_robin"]
    decisions, tokenizing, decisions_cpu, settling, early = in_situ
    steady_decided, steady_settled = steady
    matching = [d - t for d, t in zip(decisions, tokenizing, strict=True)]
    # An early decision tokenised nothing before it (the fleet records 0.0 for it).
    early_only = [d for d, t in zip(decisions, tokenizing, strict=True) if t == 0.0]
    gate = gate_comparison(states)
    return {
        "arms": per_arm,
        "cached_ratio_kv_over_rr": ratio(kv["cached_token_ratio"], rr["cached_token_ratio"]),
        "ttft_p50_rr_over_kv": rr["ttft_p50_s"] / kv["ttft_p50_s"],
        "routing_decision_p50_ms": statistics.median(decisions) * 1000,
        "routing_decision_p99_ms": statistics.quantiles(decisions, n=100)[-1] * 1000,
        "routing_match_and_cost_p50_ms": statistics.median(matching) * 1000,
        "routing_decision_cpu_p50_ms": statistics.median(decisions_cpu) * 1000,
        "routing_decisions": len(decisions),
        "routing_early_decisions": early,
        "routing_early_decision_p50_ms": statistics.median(early_only) * 1000
        if early_only else None,
        "routing_settle_p50_ms": statistics.median(settling) * 1000 if settling else None,
        "routing_steady_decision_p50_ms": statistics.median(steady_decided) * 1000,
        "routing_steady_decision_p99_ms": statistics.quantiles(steady_decided, n=100)[-1] * 1000,
        "routing_steady_settled_p50_ms": statistics.median(steady_settled) * 1000,
        "gate": {"verdict": gate.verdict, "reasons": list(gate.reasons)},
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "machine": machine(),
    }


def ratio(a: float, b: float) -> float | None:
    """a / b; None where b is 0 (with `--repeats 1` round robin can cache nothing)."""
    return a / b if b else None


def machine() -> dict[str, Any]:
    return {"cpu_model": cpu_model(), "cpus": os.cpu_count(), "flags": cpu_flags().split(),
            "load_average": os.getloadavg()}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--system-tokens", type=int, default=256)
    p.add_argument("--suffix-tokens", type=int, default=24)
    p.add_argument("--repeats", type=int, default=3, help="asks per (tenant, prompt) pair")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--num-blocks", type=int, default=160, help="KV pool of each replica")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--calibration", type=int, default=4)
    p.add_argument("--seed", type=int, default=14)
    p.add_argument("--steady-decisions", type=int, default=2000,
                   help="routing decisions timed back to back after the run")
    p.add_argument("--pin", action="store_true",
                   help="the governors (this process) on the first CPU, the replicas on the "
                        "others: the decision's cost when no engine shares the governor's core")
    p.add_argument("--out", type=Path, help="write the figures as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    args.engine_cpus = cpus[1:] if args.pin else None
    if args.pin:
        if len(cpus) < 2:
            raise SystemExit("--pin needs two CPUs or more")
        os.sched_setaffinity(0, {cpus[0]})
    with (tempfile.TemporaryDirectory(prefix="fak-fleet-bench-") as tmp,
          replicas(args, Path(tmp)) as fleet):
        result = asyncio.run(run(args, fleet, Path(tmp)))
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    kv = result["arms"]["kv_aware"]
    rr = result["arms"]["round_robin"]
    print(f"\ncached-token ratio: kv_aware {kv['cached_token_ratio']:.3f}, round_robin "
          f"{rr['cached_token_ratio']:.3f} ({times(result['cached_ratio_kv_over_rr'])})\n"
          f"TTFT p50: kv_aware {kv['ttft_p50_s'] * 1000:.0f} ms, round_robin "
          f"{rr['ttft_p50_s'] * 1000:.0f} ms ({result['ttft_p50_rr_over_kv']:.2f}x lower)\n"
          f"routing decision p50 {result['routing_decision_p50_ms']:.3f} ms "
          f"(p99 {result['routing_decision_p99_ms']:.3f} ms; without tokenising the prompt "
          f"{result['routing_match_and_cost_p50_ms']:.3f} ms; in the governor thread's CPU "
          f"time {result['routing_decision_cpu_p50_ms']:.3f} ms)\n"
          f"early decisions (before the prompt's new part was tokenised): "
          f"{result['routing_early_decisions']} of {result['routing_decisions']}, p50 "
          f"{fmt_ms(result['routing_early_decision_p50_ms'])}; settled "
          f"after the request was sent in p50 {fmt_ms(result['routing_settle_p50_ms'])}\n"
          f"routing decision back to back p50 "
          f"{result['routing_steady_decision_p50_ms']:.3f} ms "
          f"(p99 {result['routing_steady_decision_p99_ms']:.3f} ms; settled too "
          f"{result['routing_steady_settled_p50_ms']:.3f} ms)\n"
          f"gate: {result['gate']['verdict']} {result['gate']['reasons']}\n"
          f"machine: {result['machine']}")


def fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} ms"


def times(value: float | None) -> str:
    return "no ratio: round robin cached nothing" if value is None else f"{value:.2f}x"


if __name__ == "__main__":
    main()
