"""The `fak` command line. Each subcommand is a thin call into the module that owns it."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from governor.config import ConfigError
from governor.secrets import StartupRefused


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the governor (no config: dev setup on the "
                       "embedded model)")
    p.add_argument("--config", help="TOML config file")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--data-dir")
    p.add_argument("--init-key", action="store_true",
                   help="create the salt key in data_dir if it is missing")


def _add_audit(sub: argparse._SubParsersAction) -> None:
    audit = sub.add_parser("audit", help="verify the audit log, export signed checkpoints")
    asub = audit.add_subparsers(dest="audit_command", required=True, metavar="ACTION")
    verify = asub.add_parser("verify", help="verify LOG end to end; name the first bad index")
    verify.add_argument("log")
    verify.add_argument("--anchor", help="a signed checkpoint kept elsewhere (JSON file)")
    checkpoint = asub.add_parser("checkpoint", help="print the latest signed checkpoint")
    checkpoint.add_argument("--data-dir", default="./fak-data")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fak", description="Governance sidecar for LLM "
                                     "serving.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(sub)
    _add_audit(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "serve":
            from governor.serve import cmd_serve

            return cmd_serve(args.config, args.host, args.port, args.data_dir, args.init_key)
        if args.command == "audit":
            from governor.audit_log import cmd_audit_checkpoint, cmd_audit_verify

            if args.audit_command == "verify":
                return cmd_audit_verify(args.log, args.anchor)
            return cmd_audit_checkpoint(args.data_dir)
    except (ConfigError, StartupRefused) as exc:
        print(f"fak: {exc}", file=sys.stderr)
        return 2
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
