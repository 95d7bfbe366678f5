"""Which side of a vLLM KV-event socket binds (docs/reference/vllm-surfaces.md §2.2, §5).

vLLM's PUB binds when its endpoint contains `*` or `::` or is `ipc://` / `inproc://`, and
connects otherwise; its replay ROUTER always binds. A subscriber does the opposite of the
PUB, and dials `connect_host` wherever vLLM bound a wildcard address.
"""

from __future__ import annotations

import re
from typing import Literal

BindOrConnect = Literal["bind", "connect"]
_TCP = re.compile(r"tcp://(?P<host>\[[^\]]*\]|[^:/]+):(?P<port>\d{1,5})")


class KVEndpointError(ValueError):
    """An endpoint string this subscriber cannot use."""


def engine_binds(endpoint: str) -> bool:
    """True when vLLM binds this PUB endpoint (so the subscriber connects)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def dial_address(endpoint: str, connect_host: str) -> str:
    """Where to connect to an endpoint vLLM binds: wildcard hosts become `connect_host`."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return endpoint
    match = _TCP.fullmatch(endpoint)
    if match is None:
        raise KVEndpointError(
            f"KV endpoint must be tcp://host:port, ipc:// or inproc://: {endpoint!r}"
        )
    host = match["host"]
    if host in ("*", "[::]", "[*]", "0.0.0.0"):
        host = f"[{connect_host}]" if ":" in connect_host else connect_host
    return f"tcp://{host}:{match['port']}"


def subscriber_side(endpoint: str, mode: str, connect_host: str) -> tuple[BindOrConnect, str]:
    """(bind or connect, address) for the SUB socket facing vLLM's PUB `endpoint`."""
    if mode == "bind":
        return "bind", endpoint
    if mode == "connect":
        return "connect", dial_address(endpoint, connect_host)
    if mode != "auto":
        raise KVEndpointError(f"mode must be auto, bind or connect: {mode!r}")
    if engine_binds(endpoint):
        return "connect", dial_address(endpoint, connect_host)
    dial_address(endpoint, connect_host)  # validates the form
    return "bind", endpoint
