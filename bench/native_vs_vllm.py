"""Native engine against a real vLLM CPU server, side by side in one run (issue 3).

Both engines serve the same weights (fak's HF export of the embedded SmolLM2, which vLLM
loads and the native server loads too) and are driven over HTTP by the same client: httpx
async, streaming `POST /v1/completions`, greedy (temperature 0), `ignore_eos`,
`max_tokens` 128. Prompts are 120 random lowercase letters separated by spaces (as in the
recorded vLLM traffic, /work/shared/vectors), about one token per letter; every request
gets a fresh prompt, so no request reuses another's prefix.

Per concurrency level the arms run interleaved: a discarded warm-up of each engine, then
native, vLLM, native, vLLM ... (`--reps` each). Figures per engine are medians over its
reps: output tokens/s (completed output tokens / wall time of the level, as `vllm bench
serve`) and TTFT p50 (send → first streamed chunk with a choice). Each arm's warm state
goes through policies.measurement.gate_comparison, which prints COMPARABLE or NOT
COMPARABLE with the reasons.

Warm prefix: per trial a fresh 1,000-letter prefix; the first request with it is cold, the
next `--warm-per-trial` requests share it with different 8-letter suffixes; requests one
at a time, TTFT medians and cold/warm ratio per engine.

    .venv/bin/python bench/native_vs_vllm.py --vllm-url http://127.0.0.1:8011
    .venv/bin/python bench/native_vs_vllm.py --skip-vllm     # native only
    .venv/bin/python bench/native_vs_vllm.py --native-url http://127.0.0.1:8000 \\
        --vllm-url http://127.0.0.1:8011                      # already-running servers
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import socket
import statistics
import string
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from policies.measurement import ArmWarmState, gate_comparison  # noqa: E402
from schemas.bench import CompileCacheState, PrefixCacheStart, WarmState  # noqa: E402

MODEL = "smollm2"
COMPILE_LOG_LINE = re.compile(rb"(?i)\bcompiling\b|aot compiled function")


@dataclass(frozen=True)
class BenchConfig:
    """What one run measures; validated once."""

    concurrency: tuple[int, ...] = (1, 16, 64)
    requests_per_level: int | None = None  # None: max(4, requests_factor x concurrency)
    requests_factor: float = 2.0
    reps: int = 2
    prompt_letters: int = 120
    max_tokens: int = 128
    warmup_max_tokens: int = 16
    prefix_letters: int = 1000
    prefix_trials: int = 3
    warm_per_trial: int = 4
    seed: int = 0
    request_timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError("concurrency levels must be >= 1")
        for name in ("reps", "prompt_letters", "max_tokens", "warmup_max_tokens",
                     "prefix_letters", "prefix_trials", "warm_per_trial"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.requests_per_level is not None and self.requests_per_level < 1:
            raise ValueError("requests_per_level must be >= 1")
        if self.requests_factor <= 0:
            raise ValueError("requests_factor must be > 0")

    def num_requests(self, concurrency: int) -> int:
        return self.requests_per_level or max(4, round(self.requests_factor * concurrency))


@dataclass(frozen=True)
class Arm:
    """One engine behind an OpenAI-compatible URL, and what is known of its compilation."""

    name: str
    url: str
    compile_cache: CompileCacheState | None
    log_path: Path | None = None


@dataclass(frozen=True)
class RequestResult:
    ttft_s: float
    latency_s: float
    output_tokens: int
    cached_tokens: int | None


@dataclass(frozen=True)
class LevelResult:
    wall_s: float
    results: tuple[RequestResult, ...]

    @property
    def tokens_per_s(self) -> float:
        return sum(r.output_tokens for r in self.results) / self.wall_s

    @property
    def ttft_p50_s(self) -> float:
        return statistics.median(r.ttft_s for r in self.results)


@dataclass
class ArmRecord:
    """Everything measured for one engine at one concurrency level."""

    warmup_done: bool = False
    reps: list[LevelResult] = field(default_factory=list)
    compiled_during_run: bool | None = None

    def tokens_per_s(self) -> float:
        return statistics.median(r.tokens_per_s for r in self.reps)

    def ttft_p50_s(self) -> float:
        return statistics.median(r.ttft_p50_s for r in self.reps)


def random_letters(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(string.ascii_lowercase) for _ in range(count))


def completion_body(prompt: str, max_tokens: int) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


async def stream_completion(client: httpx.AsyncClient, url: str, prompt: str,
                            max_tokens: int) -> RequestResult:
    """One streaming completion; TTFT at the first chunk carrying a choice."""
    start = time.perf_counter()
    ttft, usage = None, None
    body = completion_body(prompt, max_tokens)
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - start
            usage = chunk.get("usage") or usage
    if ttft is None or usage is None:
        raise RuntimeError(f"{url}: stream ended without a token or without usage")
    details = usage.get("prompt_tokens_details") or {}
    return RequestResult(ttft, time.perf_counter() - start, int(usage["completion_tokens"]),
                         details.get("cached_tokens"))


async def run_level(client: httpx.AsyncClient, url: str, prompts: list[str],
                    concurrency: int, max_tokens: int) -> LevelResult:
    """All prompts through `concurrency` workers; results in prompt order."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(prompts)):
        queue.put_nowait(i)
    results: list[RequestResult | None] = [None] * len(prompts)

    async def worker() -> None:
        while not queue.empty():
            i = queue.get_nowait()
            results[i] = await stream_completion(client, url, prompts[i], max_tokens)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return LevelResult(time.perf_counter() - start, tuple(r for r in results if r is not None))


def log_size(arm: Arm) -> int:
    return arm.log_path.stat().st_size if arm.log_path and arm.log_path.exists() else 0


def compiled_since(arm: Arm, offset: int) -> bool | None:
    """Did the server log a compilation after `offset`? None when there is no log to read.

    vLLM logs "Compiling model ..." and "saved AOT compiled function" when it compiles; its
    "No available shared memory broadcast block ... (e.g. compilation, ...)" is a slow step,
    not a compilation, and must not count."""
    if arm.log_path is None or not arm.log_path.exists():
        return None
    with arm.log_path.open("rb") as f:
        f.seek(offset)
        return COMPILE_LOG_LINE.search(f.read()) is not None


async def measure_levels(client: httpx.AsyncClient, arms: list[Arm], cfg: BenchConfig
                         ) -> dict[int, dict[str, ArmRecord]]:
    rng = random.Random(cfg.seed)
    out: dict[int, dict[str, ArmRecord]] = {}
    for c in cfg.concurrency:
        records = {arm.name: ArmRecord() for arm in arms}
        for arm in arms:  # warm-up at this level's batch shape, discarded
            warm = [random_letters(rng, cfg.prompt_letters) for _ in range(c)]
            await run_level(client, arm.url, warm, c, cfg.warmup_max_tokens)
            records[arm.name].warmup_done = True
        offsets = {arm.name: log_size(arm) for arm in arms}
        for rep in range(cfg.reps):
            for arm in arms:
                prompts = [random_letters(rng, cfg.prompt_letters)
                           for _ in range(cfg.num_requests(c))]
                level = await run_level(client, arm.url, prompts, c, cfg.max_tokens)
                records[arm.name].reps.append(level)
                print(f"  c={c:<3} rep {rep + 1} {arm.name:<7} {level.tokens_per_s:8.1f} tok/s "
                      f" TTFT p50 {level.ttft_p50_s * 1000:8.0f} ms  wall {level.wall_s:6.1f} s",
                      flush=True)
        for arm in arms:
            records[arm.name].compiled_during_run = compiled_since(arm, offsets[arm.name])
        out[c] = records
    return out


def warm_state(arm: Arm, concurrency: int, record: ArmRecord) -> ArmWarmState:
    """First measured request (first rep, first prompt) against the median of the rest."""
    latencies = [r.latency_s for rep in record.reps for r in rep.results]
    return ArmWarmState(f"{arm.name}@c{concurrency}", WarmState(
        warmup_done=record.warmup_done,
        compile_cache=arm.compile_cache,
        request_time_compilation=record.compiled_during_run,
        prefix_cache_at_start=PrefixCacheStart.WARM_DISJOINT,  # fresh random prompts only
        first_request_latency_s=latencies[0],
        steady_state_latency_s=statistics.median(latencies[1:] or latencies),
    ))


async def prefix_experiment(client: httpx.AsyncClient, arm: Arm, cfg: BenchConfig,
                            rng: random.Random) -> tuple[list[float], list[float], list[int]]:
    """Cold and warm TTFTs (seconds) and the warm requests' cached prompt tokens."""
    cold, warm, cached = [], [], []
    for _ in range(cfg.prefix_trials):
        prefix = random_letters(rng, cfg.prefix_letters)
        first = await stream_completion(
            client, arm.url, f"{prefix} {random_letters(rng, 8)}", cfg.warmup_max_tokens)
        cold.append(first.ttft_s)
        for _ in range(cfg.warm_per_trial):
            r = await stream_completion(
                client, arm.url, f"{prefix} {random_letters(rng, 8)}", cfg.warmup_max_tokens)
            warm.append(r.ttft_s)
            cached.append(r.cached_tokens if r.cached_tokens is not None else -1)
    return cold, warm, cached


def print_levels(arms: list[Arm], levels: dict[int, dict[str, ArmRecord]]) -> None:
    names = [a.name for a in arms]
    head = "  ".join(f"{n + ' tok/s':>13} {n + ' TTFT50':>14}" for n in names)
    ratio = "  native/vllm tok/s  vllm/native TTFT" if "vllm" in names else ""
    print(f"\n{'conc':>5}  {head}{ratio}")
    for c, records in levels.items():
        cells = "  ".join(f"{records[n].tokens_per_s():13.1f} "
                          f"{records[n].ttft_p50_s() * 1000:11.0f} ms" for n in names)
        if "vllm" in names:
            nat, vl = records["native"], records["vllm"]
            cells += (f"  {nat.tokens_per_s() / vl.tokens_per_s():18.2f}"
                      f"  {vl.ttft_p50_s() / nat.ttft_p50_s():16.2f}")
        print(f"{c:>5}  {cells}")


def print_gates(arms: list[Arm], levels: dict[int, dict[str, ArmRecord]]) -> None:
    for c, records in levels.items():
        states = [warm_state(a, c, records[a.name]) for a in arms]
        for s in states:
            print(f"  warm state c={c} {s.arm}: warmup_done={s.warmup_done} "
                  f"first request {s.first_request_latency_s:.2f} s vs steady "
                  f"{s.steady_state_latency_s:.2f} s, compile_cache={s.compile_cache}, "
                  f"request_time_compilation={s.request_time_compilation}")
        if len(states) < 2:
            print(f"  c={c}: one arm only, no comparison")
            continue
        gate = gate_comparison(states)
        print(f"  c={c}: {gate.verdict}" + "".join(f"\n    - {r}" for r in gate.reasons))


async def run(cfg: BenchConfig, arms: list[Arm]) -> None:
    limits = httpx.Limits(max_connections=max(cfg.concurrency) + 8)
    async with httpx.AsyncClient(timeout=cfg.request_timeout_s, limits=limits) as client:
        for arm in arms:
            await wait_healthy(client, arm.url, 30.0)
        levels = await measure_levels(client, arms, cfg)
        print_levels(arms, levels)
        print_gates(arms, levels)
        print(f"\nwarm {cfg.prefix_letters}-letter prefix, {cfg.prefix_trials} trials x "
              f"(1 cold + {cfg.warm_per_trial} warm), requests one at a time:")
        rng = random.Random(cfg.seed + 1)
        for arm in arms:
            cold, warm, cached = await prefix_experiment(client, arm, cfg, rng)
            c50, w50 = statistics.median(cold), statistics.median(warm)
            print(f"  {arm.name:<7} cold TTFT p50 {c50 * 1000:7.0f} ms  warm {w50 * 1000:7.0f} ms"
                  f"  cold/warm {c50 / w50:5.1f}x  cached tokens (warm) {sorted(set(cached))}")


async def wait_healthy(client: httpx.AsyncClient, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.TransportError):
            if (await client.get(f"{url}/health")).status_code == 200:
                return
        await asyncio.sleep(0.5)
    raise RuntimeError(f"{url} not healthy after {timeout_s:.0f} s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def native_server(model_dir: Path | None, args: argparse.Namespace) -> Iterator[Arm]:
    """`python -m native_engine.serve.server` on a free port, stopped (SIGTERM, then kill) after."""
    port = free_port()
    log_path = ROOT / ".fak-test-cache" / "logs" / f"bench-native-{port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "native_engine.serve.server", "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", MODEL,
           "--max-model-len", str(args.max_model_len), "--block-size", str(args.block_size),
           "--num-blocks", str(args.num_blocks), "--max-num-seqs", "64",
           "--max-num-batched-tokens", str(args.native_max_batched_tokens),
           "--enable-prompt-tokens-details",
           *(["--model", str(model_dir)] if model_dir else [])]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_http(f"http://127.0.0.1:{port}", proc, 300.0, log_path)
        yield Arm("native", f"http://127.0.0.1:{port}", CompileCacheState.NOT_APPLICABLE,
                  log_path)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_http(url: str, proc: subprocess.Popen, timeout_s: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"native server exited {proc.returncode}; log {log_path}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"native server not healthy after {timeout_s:.0f} s; log {log_path}")


def export_dir() -> Path:
    """`fak model export-hf` of the embedded model into .fak-test-cache/hf-bench (once)."""
    target = ROOT / ".fak-test-cache" / "hf-bench"
    if not (target / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "governor.cli", "model", "export-hf",
                        str(target)], cwd=ROOT, check=True)
    return target


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--native-url", help="use this running native server (no /v1 suffix)")
    p.add_argument("--vllm-url", help="use this running vLLM server (no /v1 suffix)")
    p.add_argument("--skip-vllm", action="store_true", help="native only")
    p.add_argument("--vllm-enforce-eager", action="store_true")
    p.add_argument("--concurrency", default="1,16,64", help="comma-separated levels")
    p.add_argument("--requests-per-level", type=int,
                   help="requests per level and rep (default: see --requests-factor)")
    p.add_argument("--requests-factor", type=float, default=2.0,
                   help="requests per level and rep = max(4, factor x concurrency)")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prefix-trials", type=int, default=3)
    p.add_argument("--warm-per-trial", type=int, default=4)
    p.add_argument("--block-size", type=int, default=32, help="both engines (vLLM CPU: x32)")
    p.add_argument("--num-blocks", type=int, default=700, help="KV pool of each engine")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--native-max-batched-tokens", type=int, default=2048)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = BenchConfig(
        concurrency=tuple(int(c) for c in args.concurrency.split(",")),
        requests_per_level=args.requests_per_level, requests_factor=args.requests_factor,
        reps=args.reps,
        max_tokens=args.max_tokens, prefix_trials=args.prefix_trials,
        warm_per_trial=args.warm_per_trial)
    print(f"prompts: {cfg.prompt_letters} random letters separated by spaces; max_tokens "
          f"{cfg.max_tokens}, ignore_eos, temperature 0, streaming /v1/completions; "
          f"levels {cfg.concurrency}, {cfg.reps} reps, interleaved; load {load_average()}")
    with contextlib.ExitStack() as stack:
        model_dir = None if args.native_url and (args.vllm_url or args.skip_vllm) \
            else export_dir()
        arms = [Arm("native", args.native_url, CompileCacheState.NOT_APPLICABLE)
                if args.native_url else stack.enter_context(native_server(model_dir, args))]
        if args.vllm_url:
            arms.append(Arm("vllm", args.vllm_url, None))
        elif not args.skip_vllm:
            raise SystemExit("give --vllm-url (a vLLM serving `fak model export-hf`'s "
                             "directory) or --skip-vllm")
        asyncio.run(run(cfg, arms))
    print(f"load at the end {load_average()}")


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


if __name__ == "__main__":
    main()
