"""Where a KV-event socket may listen or dial (SEC-17).

KV-event streams carry every tenant's token ids and, on vLLM 0.32, their cache salts in
plaintext (docs/reference/vllm-surfaces.md §2.7). So a socket of fak's — the subscriber's
SUB or replay DEALER, the native publisher's PUB or ROUTER — stays on loopback unless the
operator opts in (`allow_remote_kv`): a wildcard (`*`, `0.0.0.0`, `[::]`, `[*]`), an interface
name, a hostname other than `localhost` or a non-loopback address is refused. `ipc://` and
`inproc://` never leave the machine. `loopback_form` turns a wildcard bind into its loopback
bind, so the native publisher keeps vLLM's default endpoint text and still listens locally.
"""

from __future__ import annotations

import ipaddress
import re

_TCP = re.compile(r"tcp://(?P<host>\[[^\]]*\]|[^:/\[\]]+):(?P<port>\d{1,5}|\*|!)")
WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "[::]", "[*]", "[0:0:0:0:0:0:0:0]"})
LOCAL_SCHEMES = ("ipc://", "inproc://")


class KVEndpointForm(ValueError):
    """Not a `tcp://host:port`, `ipc://` or `inproc://` endpoint."""


def tcp_host_port(endpoint: str) -> tuple[str, str]:
    """(host as written, brackets kept for IPv6; port, digits or `*`/`!`)."""
    match = _TCP.fullmatch(endpoint)
    if match is None:
        raise KVEndpointForm(
            f"KV endpoint must be tcp://host:port, ipc:// or inproc://: {endpoint!r}"
        )
    return match["host"], match["port"]


def is_loopback_host(host: str) -> bool:
    """127.0.0.0/8, ::1 (bracketed or not) and `localhost`; nothing else, no lookups."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def remote_refusal(endpoint: str, role: str, allow_remote: bool) -> str | None:
    """Why `endpoint` may not be used for `role` (e.g. "subscriber bind"), or None."""
    if allow_remote or endpoint.startswith(LOCAL_SCHEMES):
        return None
    host, _ = tcp_host_port(endpoint)
    if is_loopback_host(host):
        return None
    what = "every interface" if host in WILDCARD_HOSTS else f"non-loopback host {host}"
    return (
        f"KV-event {role} {endpoint!r} would use {what}; KV events carry every tenant's "
        "tokens and salts: use a loopback address, or set allow_remote_kv = true"
    )


def loopback_form(endpoint: str) -> str:
    """A wildcard tcp bind as the same bind on loopback (`[::1]` for IPv6 wildcards)."""
    if endpoint.startswith(LOCAL_SCHEMES):
        return endpoint
    host, port = tcp_host_port(endpoint)
    if host not in WILDCARD_HOSTS:
        return endpoint
    return f"tcp://{'127.0.0.1' if host in ('*', '0.0.0.0') else '[::1]'}:{port}"


def offset_endpoint_port(endpoint: str, data_parallel_rank: int) -> str:
    """The endpoint of one data-parallel rank, as vLLM derives it: tcp port + rank, inproc
    name + `_dp{rank}`; rank 0 keeps the endpoint."""
    if data_parallel_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{data_parallel_rank}"
    if "tcp" in endpoint:
        base, _, port = endpoint.rpartition(":")
        if not port.isdigit():
            raise ValueError(f"cannot offset the port of {endpoint!r}")
        return f"{base}:{int(port) + data_parallel_rank}"
    raise ValueError("Invalid endpoint: must contain 'inproc' or 'tcp'")
