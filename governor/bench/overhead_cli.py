"""`fak bench overhead` arguments; defaults are `OverheadConfig`'s."""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import fields
from pathlib import Path

from governor.bench.config import BenchConfigError
from governor.bench.governor_proc import GovernorStartError
from governor.bench.overhead_config import OverheadConfig


def _defaults() -> dict[str, object]:
    return {f.name: f.default for f in fields(OverheadConfig)}


def add_overhead_parser(sub: argparse._SubParsersAction) -> None:
    d = _defaults()
    p = sub.add_parser("overhead", help="the governor's own cost in front of an engine")
    p.add_argument("--engine", required=True, metavar="URL", help="the engine's base URL")
    p.add_argument("--config", required=True, metavar="FILE",
                   help="governor config whose [engine] base_url is --engine")
    p.add_argument("--out", metavar="DIR", help=f"default {d['out']}")
    p.add_argument("--concurrency", help=f"throughput levels (default "
                   f"{','.join(map(str, d['concurrency']))})")  # type: ignore[call-overload]
    for name in ("rounds", "per_round", "warmup", "input_len", "max_tokens", "seed"):
        p.add_argument("--" + name.replace("_", "-"), type=int, help=f"default {d[name]}")
    p.add_argument("--model")
    p.add_argument("--tokenizer")
    p.add_argument("--api-key-env", help=f"default {d['api_key_env']}")
    p.add_argument("--engine-log", help="the engine's log, read for request-time compilation")
    p.add_argument("--engine-compile-cache",
                   choices=("warm", "cold", "disabled", "not_applicable"))
    p.add_argument("--max-cv", type=float)
    p.add_argument("--settle-max-busy", type=float,
                   help=f"start a block once the machine is this idle (default "
                   f"{d['settle_max_busy']})")
    p.add_argument("--settle-timeout", type=float, dest="settle_timeout_s",
                   help=f"longest wait for it (default {d['settle_timeout_s']:g} s; 0: none)")
    p.add_argument("--no-progress", action="store_true")


def cmd_overhead(args: argparse.Namespace) -> int:
    from governor.bench.overhead import run_overhead

    given = {k: getattr(args, k) for k in ("rounds", "per_round", "warmup", "input_len",
                                           "max_tokens", "seed", "model", "api_key_env",
                                           "engine_compile_cache", "max_cv",
                                           "settle_max_busy", "settle_timeout_s")
             if getattr(args, k) is not None}
    for key in ("out", "tokenizer", "engine_log"):
        if getattr(args, key):
            given[key] = Path(getattr(args, key))
    try:
        if args.concurrency:
            given["concurrency"] = tuple(int(c) for c in args.concurrency.split(","))
        config = OverheadConfig(engine=args.engine, config=Path(args.config),
                                progress=not args.no_progress, **given)  # type: ignore[arg-type]
        outcome = asyncio.run(run_overhead(config))
    except (BenchConfigError, GovernorStartError, ValueError) as exc:
        print(f"fak bench overhead: {exc}", file=sys.stderr)
        return 2
    for line in outcome.verdicts:
        print(line)
    print((outcome.out / "report.md").read_text().split("## Governor overhead", 1)[1]
          .split("## Plan", 1)[0].strip())
    print(f"report: {outcome.report}")
    return 0 if outcome.all_comparable else 1
