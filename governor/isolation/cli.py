"""`fak audit isolation --base-url URL --key-a KEY --key-b KEY [--samples N]
[--prompt-tokens L] [--out FILE]`: the prompt-cache timing audit of any OpenAI-compatible
endpoint (docs/security.md SEC-5).

Exit codes: 0 NO CROSS-TENANT SIGNAL (and the control detected caching); 1 LEAK; 3 CONTROL
FAILED (the endpoint shows no caching even to one key: the audit proves nothing); 2 bad usage
or an endpoint that refused a request.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from governor.isolation.config import AuditConfig
from policies.isolation_audit import VERDICT_CONTROL_FAILED, VERDICT_LEAK, Thresholds

EXIT_CODES = {VERDICT_LEAK: 1, VERDICT_CONTROL_FAILED: 3}


def add_isolation_parser(actions: argparse._SubParsersAction) -> None:
    d = AuditConfig.__dataclass_fields__
    t = Thresholds()
    p = actions.add_parser(
        "isolation", help="prompt-cache timing audit (Gu et al. 2025) of an endpoint",
        description="Key A plants random prompts; key B sends prefix-sharing probes (hits) "
        "and fresh ones (misses) in random order, one at a time, max_tokens=1; a one-sided "
        "KS test on B's TTFT. The same with A probing is the positive control.")
    p.add_argument("--base-url", required=True, metavar="URL", help="the endpoint, e.g. http://host:8000")
    p.add_argument("--key-a", required=True, metavar="KEY", help="the planting tenant's API key")
    p.add_argument("--key-b", required=True, metavar="KEY", help="the probing tenant's API key")
    p.add_argument("--samples", type=int, metavar="N", default=d["samples"].default,
                   help="hit and miss samples per phase (default %(default)s)")
    p.add_argument("--prompt-tokens", type=int, metavar="L", default=d["prompt_tokens"].default,
                   help="random letters per prompt, about one token each (default "
                   "%(default)s)")
    p.add_argument("--prefix-fraction", type=float, default=d["prefix_fraction"].default)
    p.add_argument("--model", help="default: the first model /v1/models lists")
    p.add_argument("--route", choices=("completions", "chat"), default=d["route"].default)
    p.add_argument("--seed", type=int, help="default: a fresh random seed (reported)")
    p.add_argument("--warmup", type=int, default=d["warmup"].default,
                   help="discarded requests per key first (default %(default)s)")
    p.add_argument("--interval", type=float, default=d["interval_s"].default,
                   help="seconds to pause after each request (default %(default)s)")
    p.add_argument("--timeout", type=float, default=d["timeout_s"].default,
                   help="seconds per request (default %(default)s)")
    p.add_argument("--alpha", type=float, default=t.alpha,
                   help="cross-tenant p below this is a LEAK (default %(default)s)")
    p.add_argument("--control-alpha", type=float, default=t.control_alpha,
                   help="the control must reach p below this (default %(default)s)")
    p.add_argument("--out", help="write the JSON report here")


def cmd_audit_isolation(args: argparse.Namespace) -> int:
    from governor.isolation.audit import run_audit
    from governor.isolation.client import EndpointError

    try:
        config = AuditConfig(
            base_url=args.base_url, key_a=args.key_a, key_b=args.key_b, samples=args.samples,
            prompt_tokens=args.prompt_tokens, prefix_fraction=args.prefix_fraction,
            seed=args.seed, model=args.model, route=args.route, warmup=args.warmup,
            interval_s=args.interval, timeout_s=args.timeout,
            thresholds=Thresholds(args.alpha, args.control_alpha))
    except ValueError as exc:
        print(f"fak audit isolation: {exc}", file=sys.stderr)
        return 2
    try:
        report = run_audit(config)
    except EndpointError as exc:
        print(f"fak audit isolation: {exc}", file=sys.stderr)
        return 2
    for line in report.lines():
        print(line)
    if args.out:
        report.write(Path(args.out))
        print(f"report: {args.out}")
    return EXIT_CODES.get(report.verdict, 0)
