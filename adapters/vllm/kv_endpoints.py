"""Which side of a vLLM KV-event socket binds (docs/reference/vllm-surfaces.md §2.2, §5).

vLLM's PUB binds when its endpoint contains `*` or `::` or is `ipc://` / `inproc://`, and
connects otherwise; its replay ROUTER always binds. A subscriber does the opposite of the
PUB, and dials `connect_host` wherever vLLM bound a wildcard address. `local_side` adds
SEC-17's rule (policies.kv_sockets): a side that would leave loopback is refused unless the
operator allows remote KV sockets.
"""

from __future__ import annotations

from typing import Literal

from policies.kv_sockets import WILDCARD_HOSTS, KVEndpointForm, remote_refusal, tcp_host_port

BindOrConnect = Literal["bind", "connect"]


class KVEndpointError(ValueError):
    """An endpoint string this subscriber cannot use."""


def engine_binds(endpoint: str) -> bool:
    """True when vLLM binds this PUB endpoint (so the subscriber connects)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def dial_address(endpoint: str, connect_host: str) -> str:
    """Where to connect to an endpoint vLLM binds: wildcard hosts become `connect_host`."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return endpoint
    try:
        host, port = tcp_host_port(endpoint)
    except KVEndpointForm as exc:
        raise KVEndpointError(str(exc)) from None
    if not port.isdigit():
        raise KVEndpointError(f"cannot dial a KV endpoint without a port: {endpoint!r}")
    if host in WILDCARD_HOSTS:
        host = f"[{connect_host}]" if ":" in connect_host else connect_host
    return f"tcp://{host}:{port}"


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


def local_side(endpoint: str, mode: str, connect_host: str,
               allow_remote: bool) -> tuple[BindOrConnect, str]:
    """`subscriber_side`, refused (KVEndpointError) when it would leave loopback."""
    side, address = subscriber_side(endpoint, mode, connect_host)
    refusal = remote_refusal(address, f"subscriber {side}", allow_remote)
    if refusal:
        raise KVEndpointError(refusal)
    return side, address


def local_dial(endpoint: str, connect_host: str, allow_remote: bool) -> str:
    """`dial_address` for the replay ROUTER, refused when it would leave loopback."""
    address = dial_address(endpoint, connect_host)
    refusal = remote_refusal(address, "replay dial", allow_remote)
    if refusal:
        raise KVEndpointError(refusal)
    return address
