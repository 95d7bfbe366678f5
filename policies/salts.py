"""Tenant cache salts and client salt inputs (docs/design.md §3, SEC-1, SEC-2).

Derivation (SEC-1):

    salt = "fak1-" + base64url_nopad(HMAC-SHA256(K, frame("cache-salt-v1")
                                                  ‖ frame(tenant) ‖ frame(epoch)))

`frame(x)` is the 4-byte big-endian length of `x` followed by `x`. Every field is text encoded
as UTF-8; the epoch is a non-negative integer written as its decimal string with no sign,
padding or leading zeros ("0", "7", "2345"). Framing keeps ("org_1", "2345") apart from
("org_12345", ""). The "fak1-" prefix is a domain tag: a salt can never equal a plain LoRA
name or a bare digest. The result is 48 characters from `A-Z a-z 0-9 - _`, which vLLM's
salt rule accepts.

KV namespaces (SEC-17): a shadow index built from KV events names a namespace by
`namespace_digest(kv_namespace_key(K), salt)`, never by the salt itself.

Client salt inputs (SEC-2): only the governor picks a namespace, so any salt-like field a
client sends is found here for the governor to reject (400) or strip and audit.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

SALT_PREFIX = "fak1-"
SALT_DOMAIN = "cache-salt-v1"
MIN_KEY_BYTES = 32
KV_NAMESPACE_KEY_DOMAIN = "kv-namespace-key-v1"
KV_NAMESPACE_DOMAIN = "kv-namespace-v1"
NAMESPACE_PREFIX = "ns1-"

VLLM_SALT_MAX_CHARS = 128
VLLM_SALT_FORBIDDEN = ("@", "/", "\\", "\x00")
# Messages exactly as vLLM 0.32.0 puts them in `error.message` (recorded,
# docs/reference/vllm-surfaces.md §5).
VLLM_SALT_NOT_NONEMPTY = (
    "Parameter 'cache_salt' must be a non-empty string if provided. (parameter=cache_salt)"
)
VLLM_SALT_BAD_FORMAT = (
    "Parameter 'cache_salt' must be at most 128 characters and must not contain "
    "'@', '/', '\\\\', or NUL. (parameter=cache_salt)"
)

# Body keys that select a cache namespace in some engine or gateway (SEC-2):
# vLLM `cache_salt`, RFC #16016 `cache_salt_map`, PR #52655 `salt_regions`,
# TensorRT-LLM `cache_salt_id`, SGLang `extra_key`.
CLIENT_SALT_KEYS = frozenset(
    {"cache_salt", "salt_regions", "cache_salt_map", "cache_salt_id", "extra_key"}
)
# Body keys whose contents are forwarded as engine extras, so a salt may hide inside them
# (`nvext.cache_salt` for Dynamo, OpenAI-SDK `extra_body` copies, vLLM `vllm_xargs`).
CLIENT_SALT_CONTAINERS = frozenset({"extra_body", "nvext", "vllm_xargs"})
# Headers that pick a namespace or tenant upstream (Dynamo `x-tenant-id`, vLLM PR #57609
# `x-cache-salt`, and gateway spellings of the same); never forwarded, counted as dropped.
CLIENT_SALT_HEADERS = frozenset({"x-tenant-id", "x-cache-salt", "x-cache-namespace",
                                 "x-kv-namespace"})
# More salt fields than this in one body is no client mistake: refuse it (bounded work).
MAX_CLIENT_SALT_HITS = 16
# A body none of whose top-level keys is one of these holds no salt field anywhere searched.
_SEARCHED = CLIENT_SALT_KEYS | CLIENT_SALT_CONTAINERS


class SaltKeyError(ValueError):
    """The salt key is missing or too short: the governor must refuse to start."""


@dataclass(frozen=True, slots=True)
class SaltKey:
    """The HMAC key K (≥ 32 bytes). Its repr never shows the bytes."""

    secret: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.secret, bytes):
            raise SaltKeyError("salt key must be bytes")
        if len(self.secret) < MIN_KEY_BYTES:
            raise SaltKeyError(
                f"salt key is {len(self.secret)} bytes; at least {MIN_KEY_BYTES} are required"
            )

    def __repr__(self) -> str:
        return f"SaltKey(<{len(self.secret)} bytes redacted>)"

    __str__ = __repr__


def as_salt_key(key: SaltKey | bytes | bytearray | None) -> SaltKey:
    """Validate a key once; missing (None or empty) or short keys raise `SaltKeyError`."""
    if isinstance(key, SaltKey):
        return key
    if key is None or len(key) == 0:
        raise SaltKeyError("salt key is missing; refusing to derive tenant salts")
    if not isinstance(key, bytes | bytearray):
        raise SaltKeyError(f"salt key must be bytes, not {type(key).__name__}")
    return SaltKey(bytes(key))


def frame(data: bytes) -> bytes:
    """4-byte big-endian length, then the bytes."""
    if len(data) >= 2**32:
        raise ValueError("field too long to frame")
    return len(data).to_bytes(4, "big") + data


def framed_mac(secret: bytes, fields: Sequence[str]) -> bytes:
    """HMAC-SHA256(secret, frame(f1) ‖ frame(f2) ‖ …), fields UTF-8."""
    message = b"".join(frame(field.encode("utf-8")) for field in fields)
    return hmac.new(secret, message, hashlib.sha256).digest()


def _b64(digest: bytes) -> str:
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def framed_salt(key: SaltKey | bytes | bytearray | None, fields: Sequence[str]) -> str:
    """`"fak1-" + base64url(HMAC-SHA256(K, frame(f1) ‖ frame(f2) ‖ …))`, fields UTF-8."""
    return SALT_PREFIX + _b64(framed_mac(as_salt_key(key).secret, fields))


def kv_namespace_key(key: SaltKey | bytes | bytearray | None) -> bytes:
    """The key a KV shadow index digests namespaces with: HMAC(K, frame("kv-namespace-key-v1")).
    A separate key, so an index's digests never reveal or equal a salt (SEC-17)."""
    return framed_mac(as_salt_key(key).secret, (KV_NAMESPACE_KEY_DOMAIN,))


def namespace_digest(namespace_key: bytes, salt: str) -> str:
    """How a shadow index names the namespace of `salt`: `"ns1-" + base64url(HMAC(kns,
    frame("kv-namespace-v1") ‖ frame(salt)))`. Deterministic per key, one-way without it."""
    if len(namespace_key) < MIN_KEY_BYTES:
        raise SaltKeyError("namespace key must be at least 32 bytes")
    return NAMESPACE_PREFIX + _b64(framed_mac(namespace_key, (KV_NAMESPACE_DOMAIN, salt)))


def epoch_text(epoch: int) -> str:
    """The documented epoch encoding: decimal string of a non-negative int."""
    if isinstance(epoch, bool) or not isinstance(epoch, int):
        raise TypeError(f"epoch must be an int, not {type(epoch).__name__}")
    if epoch < 0:
        raise ValueError(f"epoch must be >= 0, got {epoch}")
    return str(epoch)


def tenant_salt(key: SaltKey | bytes | bytearray | None, tenant: str, epoch: int) -> str:
    """The cache salt of `tenant` at `epoch` (SEC-1)."""
    if not isinstance(tenant, str) or not tenant:
        raise ValueError("tenant must be a non-empty string")
    return framed_salt(key, (SALT_DOMAIN, tenant, epoch_text(epoch)))


def validate_vllm_cache_salt(salt: object) -> str | None:
    """vLLM 0.32.0's `cache_salt` rule: the error message it would answer, or None if valid.

    Absent (None) is valid. Non-strings and "" get the non-empty message (vLLM checks this
    before field typing, without stripping); then ≤ 128 characters and no `@ / \\ NUL`.
    """
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        return VLLM_SALT_NOT_NONEMPTY
    if len(salt) > VLLM_SALT_MAX_CHARS or any(c in salt for c in VLLM_SALT_FORBIDDEN):
        return VLLM_SALT_BAD_FORMAT
    return None


@dataclass(frozen=True, slots=True)
class ClientSaltField:
    """Where a client-supplied salt input sits in a request body: the key path."""

    path: tuple[str | int, ...]

    @property
    def dotted(self) -> str:
        return ".".join(str(part) for part in self.path)


class TooManyClientSalts(ValueError):
    """More client salt fields than one body may carry (`max_hits`)."""


def find_client_salts(body: Mapping[str, Any],
                      max_hits: int = MAX_CLIENT_SALT_HITS) -> tuple[ClientSaltField, ...]:
    """Every salt alias in `body`: at top level, and at any depth inside the containers.

    Keys match case-insensitively. Other fields (`messages`, `tools`, `response_format`) are
    not searched, so a tool parameter that happens to be named `cache_salt` is not a hit.
    One pass over the containers; more than `max_hits` hits raise TooManyClientSalts.
    """
    if _nothing_searched(body):
        return ()
    return _scan(body, max_hits, copy=False)[1]


def strip_client_salts(
    body: Mapping[str, Any], max_hits: int = MAX_CLIENT_SALT_HITS
) -> tuple[dict[str, Any], tuple[ClientSaltField, ...]]:
    """A new dict without the fields `find_client_salts` reports, and those fields.

    The input is not modified. One pass, linear in the size of the searched containers
    (a key path is built only for a hit).
    """
    if _nothing_searched(body):
        return dict(body), ()
    return _scan(body, max_hits, copy=True)


def _nothing_searched(body: Mapping[str, Any]) -> bool:
    """Whether no top-level key is a salt or a container: the common body, cleared by one
    set operation (0.6 µs against the scan's 1.8 for a plain completion body). Anything
    but a dict of string keys is left to `_scan`."""
    if not isinstance(body, dict):
        return False
    try:
        return _SEARCHED.isdisjoint(map(str.lower, body))
    except TypeError:  # a key that is no string
        return False


# A key path as a chain of (parent, key) links, turned into a tuple only for a hit.
_Link = tuple[Any, str | int] | None


def _path(link: _Link) -> tuple[str | int, ...]:
    parts: list[str | int] = []
    while link is not None:
        link, key = link
        parts.append(key)
    return tuple(reversed(parts))


def _scan(body: Mapping[str, Any], max_hits: int, copy: bool
          ) -> tuple[dict[str, Any], tuple[ClientSaltField, ...]]:
    if not isinstance(body, Mapping):
        raise TypeError("request body must be a JSON object")
    scan = _SaltScan(max_hits, copy)
    stripped: dict[str, Any] = {}
    for key, value in body.items():
        name = str(key).lower()
        if name in CLIENT_SALT_KEYS:
            scan.hit((None, key))
            continue
        stripped[key] = scan.walk(value, (None, key)) if name in CLIENT_SALT_CONTAINERS \
            else value
    return stripped, tuple(sorted(scan.hits, key=lambda f: f.dotted))


class _SaltScan:
    """One scan's hits. A class, not nested functions: a recursive closure is a reference
    cycle, garbage only the collector frees, and one per request made most of the
    governor's young collections (issue 19)."""

    def __init__(self, max_hits: int, copy: bool) -> None:
        self.hits: list[ClientSaltField] = []
        self.max_hits = max_hits
        self.copy = copy

    def hit(self, link: _Link) -> None:
        self.hits.append(ClientSaltField(_path(link)))
        if len(self.hits) > self.max_hits:
            raise TooManyClientSalts(f"the body carries more than {self.max_hits} cache "
                                     "salt fields")

    def walk(self, value: Any, link: _Link) -> Any:
        if isinstance(value, Mapping):
            out = {}
            for key, child in value.items():
                if isinstance(key, str) and key.lower() in CLIENT_SALT_KEYS:
                    self.hit((link, key))
                else:
                    kept = self.walk(child, (link, key))
                    if self.copy:
                        out[key] = kept
            return out if self.copy else value
        if isinstance(value, list):
            kept_items = [self.walk(child, (link, i)) for i, child in enumerate(value)]
            return kept_items if self.copy else value
        return value


def find_client_salt_headers(header_names: Iterable[str]) -> tuple[str, ...]:
    """The header names (as given) that would pick a namespace upstream."""
    names = tuple(header_names)
    if CLIENT_SALT_HEADERS.isdisjoint(map(str.lower, names)):  # the common request
        return ()
    return tuple(name for name in names if name.lower() in CLIENT_SALT_HEADERS)
