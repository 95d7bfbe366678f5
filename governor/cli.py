"""The `fak` command line. Each subcommand is a thin call into the module that owns it."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from governor.admin_client import add_quarantine_parser, add_tenants_parser
from governor.bench.cli import add_bench_parser
from governor.config import ConfigError, ServerConfig
from governor.isolation.cli import add_isolation_parser
from governor.secrets import StartupRefused


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the governor (no config: dev setup on the "
                       "embedded model)")
    p.add_argument("--config", help="TOML config file")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--metrics-port", type=int, help="the private /metrics listener "
                   "(default: port + 1; 0: any free port)")
    p.add_argument("--data-dir")
    p.add_argument("--init-key", action="store_true",
                   help="create the salt key in data_dir if it is missing")
    p.add_argument("--workers", type=int, help="governor processes sharing the port "
                   f"(SO_REUSEPORT; more than 1 needs the postgres state backend; default: "
                   f"[server] workers, else {ServerConfig().workers})")


def _add_audit(sub: argparse._SubParsersAction) -> None:
    audit = sub.add_parser("audit", help="verify the audit log, export signed checkpoints, "
                           "audit cache isolation")
    asub = audit.add_subparsers(dest="audit_command", required=True, metavar="ACTION")
    verify = asub.add_parser("verify", help="verify LOG end to end; name the first bad index")
    verify.add_argument("log", nargs="?", help="the log file, or a postgresql:// DSN (prefer "
                        "--dsn-env: a DSN on the command line is visible to other users)")
    verify.add_argument("--dsn-env", metavar="VAR", help="verify the shared log in the "
                        "PostgreSQL database whose DSN is in $VAR")
    verify.add_argument("--anchor", help="a signed checkpoint kept elsewhere (JSON file), or "
                        "an anchor_dir (its latest export is used)")
    checkpoint = asub.add_parser("checkpoint", help="print the latest signed checkpoint")
    checkpoint.add_argument("--data-dir", default="./fak-data")
    checkpoint.add_argument("--signing-key", help="the log's signing key, when [audit] "
                            "signing_key_path keeps it outside the data dir")
    checkpoint.add_argument("--dsn-env", metavar="VAR", help="the shared log in the "
                            "PostgreSQL database whose DSN is in $VAR")
    add_isolation_parser(asub)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="print one completion from the native engine")
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int)
    p.add_argument("--model", help="GGUF file or HF directory (default: the embedded model)")
    p.add_argument("--attention-backend", choices=("auto", "triton", "torch"), default="auto")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")


def _add_model(sub: argparse._SubParsersAction) -> None:
    model = sub.add_parser("model", help="model utilities")
    msub = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    export = msub.add_parser("export-hf", help="write the loaded model as an HF directory")
    export.add_argument("outdir")


def _add_engine(sub: argparse._SubParsersAction) -> None:
    engine = sub.add_parser("engine", help="the native engine")
    esub = engine.add_subparsers(dest="engine_command", required=True, metavar="ACTION")
    esub.add_parser("serve", help="serve the native engine on vLLM's three surfaces "
                    "(see fak engine serve --help)", add_help=False)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fak", description="Governance sidecar for LLM "
                                     "serving.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(sub)
    _add_engine(sub)
    _add_generate(sub)
    _add_model(sub)
    _add_audit(sub)
    add_quarantine_parser(sub)
    add_tenants_parser(sub)
    add_bench_parser(sub)
    return parser


def _dsn_arg(var: str | None) -> str | None:
    if var is None:
        return None
    dsn = os.environ.get(var, "").strip()
    if not dsn:
        raise ConfigError(f"${var} holds no DSN")
    return dsn


def _audit(args: argparse.Namespace) -> int:
    from governor.audit.cli import (
        cmd_audit_checkpoint,
        cmd_audit_checkpoint_dsn,
        cmd_audit_verify,
    )

    dsn = _dsn_arg(args.dsn_env)
    if args.audit_command == "verify":
        if (args.log is None) == (dsn is None):
            raise ConfigError("fak audit verify takes a LOG (or DSN) or --dsn-env, one of them")
        return cmd_audit_verify(str(args.log or dsn), args.anchor)
    if dsn is not None:
        return cmd_audit_checkpoint_dsn(dsn, args.signing_key)
    return cmd_audit_checkpoint(args.data_dir, args.signing_key)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["engine", "serve"]:
        # Its flags mirror vLLM's and belong to the server's own parser.
        from native_engine.serve.server import main as engine_serve_main

        return engine_serve_main(argv[2:], prog="fak engine serve")
    args = build_parser().parse_args(argv)
    try:
        if args.command == "serve":
            from governor.serve import cmd_serve

            return cmd_serve(args.config, args.host, args.port, args.data_dir, args.init_key,
                             args.metrics_port, args.workers)
        if args.command == "generate":
            from native_engine.generate_cli import cmd_generate

            return cmd_generate(args.prompt, args.chat, args.max_tokens, args.temperature,
                                args.seed, args.model, args.attention_backend, args.device)
        if args.command == "model":
            from native_engine.model.export_hf import cmd_export_hf

            return cmd_export_hf(args.outdir)
        if args.command == "quarantine":
            from governor.admin_client import cmd_quarantine

            return cmd_quarantine(args)
        if args.command == "tenants":
            from governor.admin_client import cmd_tenants

            return cmd_tenants(args)
        if args.command == "bench":
            from governor.bench.cli import cmd_bench

            return cmd_bench(args)
        if args.command == "audit" and args.audit_command == "isolation":
            from governor.isolation.cli import cmd_audit_isolation

            return cmd_audit_isolation(args)
        if args.command == "audit":
            return _audit(args)
    except (ConfigError, StartupRefused) as exc:
        print(f"fak: {exc}", file=sys.stderr)
        return 2
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
