"""`fak bench ab` and `fak bench overhead`: argument parsing into the validated configs.

    fak bench ab --arm NAME=URL --arm NAME=URL [--through-governor CONFIG] [--plan FILE]
                 [--out DIR] [--workload random|prefix-repetition|multi-turn|tenant-mix] ...
    fak bench overhead --engine URL --config FILE [--out DIR] ...

Flags override a `--plan` file's keys; every default is the config dataclass's. API keys
come from the environment variable `--api-key-env` names (default FAK_BENCH_API_KEY),
comma-separated for tenant-mix.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from types import FrameType
from typing import Any

from governor.bench.config import (
    METRICS,
    WORKLOADS,
    ABConfig,
    BenchConfigError,
    WorkloadConfig,
    arms_from,
    load_plan_file,
    parse_arm,
    parse_goodput,
    with_arm_details,
)
from governor.bench.quiet import WINDOW_S

AB_DEFAULTS = {f.name: f.default for f in fields(ABConfig)}
WORKLOAD_DEFAULTS = {f.name: f.default for f in fields(WorkloadConfig)}


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _pairs(items: list[str] | None, flag: str) -> dict[str, str]:
    out = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not (sep and name and value):
            raise BenchConfigError(f"{flag} wants NAME=VALUE, got {item!r}")
        out[name] = value
    return out


def _add_ab(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ab", help="compare two or more endpoints, interleaved, with a verdict")
    p.add_argument("--arm", action="append", metavar="NAME=URL",
                   help="an OpenAI-compatible server's base URL (repeat)")
    p.add_argument("--through-governor", metavar="CONFIG",
                   help="also run `fak serve --config CONFIG` for the run, as an arm")
    p.add_argument("--governor-arm", help=f"its arm name (default {AB_DEFAULTS['governor_arm']})")
    p.add_argument("--plan", metavar="FILE", help="TOML with these settings (flags win)")
    p.add_argument("--out", metavar="DIR", help="output directory (default ./fak-bench-out)")
    p.add_argument("--workload", choices=WORKLOADS,
                   help=f"default {WORKLOAD_DEFAULTS['name']}")
    for name in ("input_len", "output_len", "prefix_len", "num_prefixes", "turns"):
        p.add_argument("--" + name.replace("_", "-"), type=int,
                       help=f"default {WORKLOAD_DEFAULTS[name]}")
    p.add_argument("--range-ratio", type=float, help="input length spread (random), default 0")
    p.add_argument("--concurrency", type=_ints, help="levels, e.g. 1,16,64 (default 1)")
    p.add_argument("--request-rate", type=_floats, help="req/s levels (gamma arrivals)")
    p.add_argument("--burstiness", type=float, help="gamma shape, 1 = Poisson")
    p.add_argument("--blocks", type=int, help=f"blocks per arm (default {AB_DEFAULTS['blocks']})")
    p.add_argument("--requests-per-block", type=int,
                   help="default max(--min-requests, --requests-factor x concurrency)")
    p.add_argument("--requests-factor", type=float,
                   help=f"default {AB_DEFAULTS['requests_factor']}")
    p.add_argument("--min-requests", type=int, help=f"default {AB_DEFAULTS['min_requests']}")
    p.add_argument("--warmup-requests", type=int, help="default max(2, concurrency)")
    p.add_argument("--seed", type=int)
    p.add_argument("--order", choices=("interleaved", "sequential"),
                   help="sequential only to show what interleaving guards against")
    p.add_argument("--metric", choices=METRICS, help=f"default {AB_DEFAULTS['metric']}")
    p.add_argument("--goodput", nargs="+", metavar="KEY:MS", help="SLOs: ttft, tpot, e2el")
    p.add_argument("--model", help="served model name (default: the first arm's)")
    p.add_argument("--tokenizer", help="tokenizer.json, an HF dir or a GGUF "
                   "(default: the embedded model)")
    p.add_argument("--api-key-env", help=f"default {AB_DEFAULTS['api_key_env']}")
    p.add_argument("--arm-log", action="append", metavar="NAME=PATH",
                   help="the arm's server log, read for request-time compilation")
    p.add_argument("--arm-compile-cache", action="append", metavar="NAME=STATE",
                   help="state the arm's compile cache (warm, cold, disabled, "
                   "not_applicable) when the arm cannot tell it")
    p.add_argument("--request-timeout", type=float, dest="request_timeout_s")
    p.add_argument("--max-cv", type=float, help="refuse above this per-block CV (0.10)")
    p.add_argument("--settle-max-busy", type=float,
                   help="start a block once all CPUs together are at most this busy over "
                   f"{WINDOW_S:g} s (default {AB_DEFAULTS['settle_max_busy']})")
    p.add_argument("--settle-timeout", type=float, dest="settle_timeout_s",
                   help="wait at most this long for it, else refuse the level's pairs "
                   f"(default {AB_DEFAULTS['settle_timeout_s']:g} s; 0: no wait)")
    p.add_argument("--run-id", help="replay an earlier run's prompts (its plan.json run_id)")
    p.add_argument("--no-progress", action="store_true")


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="honest A/B benchmarks (ab, overhead)")
    bsub = bench.add_subparsers(dest="bench_command", required=True, metavar="ACTION")
    _add_ab(bsub)
    from governor.bench.overhead_cli import add_overhead_parser

    add_overhead_parser(bsub)


WORKLOAD_FLAGS = ("input_len", "output_len", "prefix_len", "num_prefixes", "turns",
                  "range_ratio")
AB_FLAGS = ("concurrency", "request_rate", "burstiness", "blocks", "requests_per_block",
            "requests_factor", "min_requests",
            "warmup_requests", "seed", "order", "metric", "model", "api_key_env",
            "governor_arm", "request_timeout_s", "max_cv", "settle_max_busy",
            "settle_timeout_s", "run_id")


def ab_config(args: argparse.Namespace) -> ABConfig:
    raw: dict[str, Any] = load_plan_file(Path(args.plan)) if args.plan else {}
    arms = arms_from(raw.pop("arms", {}))
    cli_arms = [parse_arm(a) for a in args.arm or []]
    if cli_arms:
        arms = arms_from(dict(cli_arms))
    compile_cache = _pairs(args.arm_compile_cache, "--arm-compile-cache")
    governor_arm = str(args.governor_arm or raw.get("governor_arm") or AB_DEFAULTS["governor_arm"])
    arms = with_arm_details(arms, _pairs(args.arm_log, "--arm-log"), compile_cache,
                            governor_arm)
    if governor_arm in compile_cache:
        raw["governor_compile_cache"] = compile_cache[governor_arm]
    workload = {k: raw.pop(k) for k in WORKLOAD_FLAGS if k in raw}
    workload["name"] = raw.pop("workload", WORKLOAD_DEFAULTS["name"])
    for key in WORKLOAD_FLAGS:
        if getattr(args, key) is not None:
            workload[key] = getattr(args, key)
    if args.workload:
        workload["name"] = args.workload
    for key in AB_FLAGS:
        if getattr(args, key) is not None:
            raw[key] = getattr(args, key)
    for key in ("concurrency", "request_rate"):
        if isinstance(raw.get(key), list):
            raw[key] = tuple(raw[key])
    if args.goodput:
        raw["goodput"] = parse_goodput(args.goodput)
    elif isinstance(raw.get("goodput"), dict):
        raw["goodput"] = tuple(raw["goodput"].items())
    governor = args.through_governor or raw.pop("through_governor", None)
    tokenizer = args.tokenizer or raw.pop("tokenizer", None)
    out = args.out or raw.pop("out", "fak-bench-out")
    raw.pop("through_governor", None)
    raw.pop("tokenizer", None)
    try:
        return ABConfig(arms=arms, out=Path(out), workload=WorkloadConfig(**workload),
                        through_governor=Path(governor) if governor else None,
                        tokenizer=Path(tokenizer) if tokenizer else None,
                        progress=not args.no_progress, **raw)
    except TypeError as exc:
        raise BenchConfigError(str(exc)) from exc


class _SigtermAsSigint:
    """SIGTERM (a `kill`, a CI timeout) unwinds the run as Ctrl-C does, so the governor a run
    started is stopped rather than left serving.

    It calls whatever handles SIGINT at that moment: inside `asyncio.run` that handler
    cancels the main task, so the exception never lands in another task mid-write. Where
    SIGINT is ignored (a job a non-interactive shell put in the background) or left to the
    OS, `asyncio.run` installs no handler: the event loop then raises KeyboardInterrupt
    itself, from a callback between task steps, and `asyncio.run` cancels every task. With
    no loop running, KeyboardInterrupt is raised where the run is."""

    def __init__(self) -> None:
        self.received = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.received = True
        on_sigint = signal.getsignal(signal.SIGINT)
        if callable(on_sigint):
            on_sigint(signal.SIGINT, frame)
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise KeyboardInterrupt from None
        loop.call_soon_threadsafe(_interrupt)


def _interrupt() -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[_SigtermAsSigint]:
    """Installs `_SigtermAsSigint` for the block; the old handler is back afterwards."""
    handler = _SigtermAsSigint()
    if threading.current_thread() is not threading.main_thread():
        yield handler  # only the main thread may set handlers; a caller there keeps its own
        return
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield handler
    finally:
        signal.signal(signal.SIGTERM, previous)


def cmd_bench(args: argparse.Namespace) -> int:
    with _sigterm_interrupts() as sigterm:
        try:
            return _bench(args)
        except KeyboardInterrupt:
            print("fak bench: stopped before the end; what it started is stopped",
                  file=sys.stderr)
            return 128 + (signal.SIGTERM if sigterm.received else signal.SIGINT)


def _bench(args: argparse.Namespace) -> int:
    try:
        if args.bench_command == "overhead":
            from governor.bench.overhead_cli import cmd_overhead

            return cmd_overhead(args)
        config = ab_config(args)
    except BenchConfigError as exc:
        print(f"fak bench: {exc}", file=sys.stderr)
        return 2
    from governor.bench.ab import run_ab
    from governor.bench.governor_proc import GovernorStartError

    try:
        outcome = asyncio.run(run_ab(config))
    except (BenchConfigError, GovernorStartError) as exc:
        print(f"fak bench: {exc}", file=sys.stderr)
        return 2
    for line in outcome.verdicts:
        print(line)
    print(f"report: {outcome.report}")
    print(f"artifacts: {', '.join(str(p) for p in outcome.artifacts)}")
    return 0 if outcome.all_comparable else 1
