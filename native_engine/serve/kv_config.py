"""`--kv-events-config` of `fak engine serve`: vLLM's keys, and its endpoint rules."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Literal

from policies.kv_sockets import KVEndpointForm, loopback_form, remote_refusal
from schemas.values import is_int

PublisherKind = Literal["zmq", "null"]


def _check_endpoint(name: str, value: Any) -> None:
    if not isinstance(value, str) or "://" not in value:
        raise ValueError(f"{name} must be a ZeroMQ endpoint like 'tcp://*:5557', got {value!r}")


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's `--kv-events-config` keys (same names and defaults) plus three fak flags:
    `legacy_array_format` (S3 positional events instead of maps), `int_block_hashes`
    (False: whole 32-byte digests, like VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) and
    `allow_remote_kv` (SEC-17: without it every socket stays on loopback — a wildcard bind
    such as vLLM's default `tcp://*:5557` listens on 127.0.0.1, and a non-loopback address
    is refused here). `publisher` None resolves as vLLM does: "zmq" when events are enabled,
    else "null"."""

    enable_kv_cache_events: bool = False
    publisher: PublisherKind | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    legacy_array_format: bool = False
    int_block_hashes: bool = True
    allow_remote_kv: bool = False

    def __post_init__(self) -> None:
        for name in ("enable_kv_cache_events", "legacy_array_format", "int_block_hashes",
                     "allow_remote_kv"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if self.publisher is None:
            resolved = "zmq" if self.enable_kv_cache_events else "null"
            object.__setattr__(self, "publisher", resolved)
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"publisher must be 'zmq' or 'null', got {self.publisher!r}")
        _check_endpoint("endpoint", self.endpoint)
        if self.replay_endpoint is not None:
            _check_endpoint("replay_endpoint", self.replay_endpoint)
        for name, minimum in (("buffer_steps", 0), ("hwm", 0), ("max_queue_size", 1)):
            value = getattr(self, name)
            if not is_int(value) or value < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
        if not isinstance(self.topic, str):
            raise ValueError(f"topic must be a string, got {self.topic!r}")
        self.socket_address(self.endpoint, "PUB")
        if self.replay_endpoint is not None:
            self.socket_address(self.replay_endpoint, "replay ROUTER", binds=True)

    def socket_address(self, endpoint: str, role: str, binds: bool | None = None) -> str:
        """The address a socket of this publisher uses for `endpoint` (vLLM's bind rule
        unless `binds` says): a wildcard bind becomes its loopback bind unless remote KV is
        allowed; an address off loopback raises ValueError unless it is allowed."""
        bind = endpoint_binds(endpoint) if binds is None else binds
        try:
            address = endpoint if self.allow_remote_kv or not bind else loopback_form(endpoint)
            refusal = remote_refusal(address, f"publisher {role}", self.allow_remote_kv)
        except KVEndpointForm as exc:
            raise ValueError(str(exc)) from None
        if refusal:
            raise ValueError(refusal)
        return address

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse a `--kv-events-config '<json>'` value; unknown keys are an error."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(
                f"--kv-events-config has unknown keys {unknown}; allowed: {sorted(known)}"
            )
        return cls(**raw)


def endpoint_binds(endpoint: str) -> bool:
    """vLLM's rule: bind for wildcard/IPv6/ipc/inproc endpoints, connect otherwise."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
