"""`fak quarantine` and `fak tenants`: the operator's side of the admin API, over HTTP.

    fak quarantine --tenant T (--text S | --messages-file F | --token-ids 1,2,3) [--start N]
                   --reason R [--require-exact] [--url URL] [--admin-token-env VAR]
    fak quarantine show ID [--url URL] [--admin-token-env VAR]
    fak tenants rotate ID [--url URL] [--admin-token-env VAR]

The admin token is read from an environment variable (default FAK_ADMIN_TOKEN), never from
the command line, where other users could read it. The URL defaults to $FAK_URL, else
http://127.0.0.1:8000. Each command prints the governor's JSON answer.

Exit codes: 0 the record is VERIFIED (quarantine) or the call succeeded (show, rotate);
1 a quarantine ended UNVERIFIED, FAILED or REFUSED; 2 bad usage, an HTTP error or no answer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx

DEFAULT_URL = "http://127.0.0.1:8000"
URL_ENV = "FAK_URL"
TOKEN_ENV = "FAK_ADMIN_TOKEN"
QUARANTINE_TIMEOUT_S = 600.0


class AdminClientError(Exception):
    """The governor could not be asked, or answered an error."""


class AdminClient:
    """A small synchronous client of the governor's admin routes."""

    def __init__(self, url: str, token: str, timeout_s: float = QUARANTINE_TIMEOUT_S) -> None:
        if not url.startswith(("http://", "https://")):
            raise AdminClientError(f"--url must start with http:// or https://, got {url!r}")
        self.url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"}
        self.timeout_s = timeout_s

    def quarantine(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", "/admin/v1/quarantine", body)

    def show(self, quarantine_id: str) -> dict[str, Any]:
        return self._call("GET", f"/admin/v1/quarantine/{_path_part(quarantine_id)}")

    def rotate(self, tenant_id: str) -> dict[str, Any]:
        return self._call("POST", f"/admin/v1/tenants/{_path_part(tenant_id)}/rotate")

    def _call(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        try:
            response = httpx.request(method, self.url + path, json=body, headers=self._headers,
                                     timeout=self.timeout_s, trust_env=False)
        except httpx.HTTPError as exc:
            raise AdminClientError(f"{method} {self.url}{path}: {exc!r}") from exc
        try:
            answer = response.json()
        except ValueError:
            answer = None
        if response.status_code != 200 or not isinstance(answer, dict):
            message = (answer or {}).get("error", {}).get("message") if isinstance(
                answer, dict) else response.text[:200]
            raise AdminClientError(f"{method} {path}: HTTP {response.status_code}: {message}")
        return answer


def _path_part(value: str) -> str:
    if not value or any(c in value for c in "/?#%\\") or value in (".", ".."):
        raise AdminClientError(f"not a usable id: {value!r}")
    return value


# --- argument parsing -------------------------------------------------------------------------


def _connection_options(parser: argparse.ArgumentParser, suppress: bool) -> None:
    """--url / --admin-token-env; on a sub-parser their defaults are suppressed so they do
    not overwrite values given before the sub-command."""
    parser.add_argument("--url", default=argparse.SUPPRESS if suppress else None,
                        help=f"governor base URL (default ${URL_ENV} or {DEFAULT_URL})")
    parser.add_argument("--admin-token-env", default=argparse.SUPPRESS if suppress else TOKEN_ENV,
                        metavar="VAR", help=f"environment variable holding the admin token "
                        f"(default {TOKEN_ENV})")


def add_quarantine_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quarantine", help="quarantine a cached span (or `show ID`)")
    _connection_options(p, suppress=False)
    p.add_argument("--tenant")
    span = p.add_mutually_exclusive_group()
    span.add_argument("--text", help="the span as a completions prompt")
    span.add_argument("--messages-file", help="JSON file: the span as a list of chat messages")
    span.add_argument("--token-ids", help="the span as comma-separated token ids")
    p.add_argument("--start", type=int, default=0, help="token offset where the span starts")
    p.add_argument("--reason", help="a reason code for the audit log, e.g. ticket-4711")
    p.add_argument("--require-exact", action="store_true",
                   help="refuse rather than degrade to a flush or a rotation")
    actions = p.add_subparsers(dest="quarantine_action", metavar="show")
    show = actions.add_parser("show", help="print a quarantine record by id")
    show.add_argument("id")
    _connection_options(show, suppress=True)


def add_tenants_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tenants", help="tenant administration")
    actions = p.add_subparsers(dest="tenants_action", required=True, metavar="ACTION")
    rotate = actions.add_parser("rotate", help="bump a tenant's salt epoch (SEC-10)")
    rotate.add_argument("id")
    _connection_options(rotate, suppress=False)


# --- commands ---------------------------------------------------------------------------------


def cmd_quarantine(args: argparse.Namespace) -> int:
    try:
        client = _client(args)
        if args.quarantine_action == "show":
            return _print(client.show(args.id), 0)
        record = client.quarantine(quarantine_body(args))
    except AdminClientError as exc:
        print(f"fak quarantine: {exc}", file=sys.stderr)
        return 2
    return _print(record, 0 if record.get("state") == "VERIFIED" else 1)


def cmd_tenants(args: argparse.Namespace) -> int:
    try:
        return _print(_client(args).rotate(args.id), 0)
    except AdminClientError as exc:
        print(f"fak tenants: {exc}", file=sys.stderr)
        return 2


def quarantine_body(args: argparse.Namespace) -> dict[str, Any]:
    """The POST body from the command line; missing pieces are usage errors."""
    if not args.tenant or not args.reason:
        raise AdminClientError("--tenant and --reason are required")
    span: dict[str, Any]
    if args.text is not None:
        span = {"text": args.text}
    elif args.messages_file is not None:
        span = {"messages": _messages(Path(args.messages_file))}
    elif args.token_ids is not None:
        span = {"token_ids": _token_ids(args.token_ids)}
    else:
        raise AdminClientError("one of --text, --messages-file, --token-ids is required")
    return {"tenant": args.tenant, "span": span, "start": args.start, "reason": args.reason,
            "require_exact": args.require_exact}


def _messages(path: Path) -> list[Any]:
    try:
        messages = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise AdminClientError(f"cannot read messages from {path}: {exc}") from exc
    if not isinstance(messages, list) or not messages:
        raise AdminClientError(f"{path} must hold a non-empty JSON list of chat messages")
    return messages


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError as exc:
        raise AdminClientError(f"--token-ids must be comma-separated integers: {exc}") from exc
    if not ids or any(i < 0 for i in ids):
        raise AdminClientError("--token-ids must be non-negative integers")
    return ids


def _client(args: argparse.Namespace) -> AdminClient:
    token = os.environ.get(args.admin_token_env)
    if not token:
        raise AdminClientError(f"the admin token is not set: export {args.admin_token_env}")
    return AdminClient(args.url or os.environ.get(URL_ENV) or DEFAULT_URL, token)


def _print(doc: dict[str, Any], code: int) -> int:
    print(json.dumps(doc, indent=2, sort_keys=True))
    return code
