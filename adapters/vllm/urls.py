"""The only way this package builds an engine URL (docs/design.md §1).

Every URL comes out of `guarded_url`, which checks the request line against an allowlist and
fails closed: a path outside the allowlist, or one whose decoded form contains `..`,
`/internal`, `/debug`, `/admin`, `/private`, a backslash or a control character, is refused
before any socket opens. `EngineURLs` offers one method per allowed public surface; the
dev-mode control client has its own allowlist (adapters/vllm/dev_control.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

import httpx

PUBLIC_SURFACES: frozenset[tuple[str, str]] = frozenset(
    {
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("GET", "/v1/models"),
        ("GET", "/metrics"),
        ("GET", "/health"),
        ("GET", "/version"),
    }
)
FORBIDDEN_MARKERS: tuple[str, ...] = ("..", "/internal", "/debug", "/admin", "/private", "\\")
_MAX_DECODE_ROUNDS = 8


class ForbiddenURLError(ValueError):
    """A URL this package must never emit."""


@dataclass(frozen=True, slots=True)
class EngineEndpoint:
    """A checked request line: the method and the absolute URL."""

    method: str
    url: httpx.URL


def fully_decoded(text: str) -> str:
    """Percent-decode until stable, so `%252e%252e` cannot hide `..`."""
    for _ in range(_MAX_DECODE_ROUNDS):
        decoded = unquote(text)
        if decoded == text:
            return decoded
        text = decoded
    raise ForbiddenURLError(f"path keeps decoding after {_MAX_DECODE_ROUNDS} rounds: {text!r}")


def check_clean_path(path: str) -> None:
    """Refuse a path whose decoded form carries a forbidden marker or a control char."""
    decoded = fully_decoded(path).lower()
    if any(marker in decoded for marker in FORBIDDEN_MARKERS):
        raise ForbiddenURLError(f"forbidden path {path!r}")
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in decoded) or "%" in decoded:
        raise ForbiddenURLError(f"path with control or escape characters {path!r}")
    if "?" in decoded or "#" in decoded:
        raise ForbiddenURLError(f"path with query or fragment {path!r}")


def parse_base_url(base_url: str) -> tuple[str, str]:
    """Validate an engine base URL; return (origin, path prefix without trailing slash)."""
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ForbiddenURLError(f"engine base URL must be http(s)://host[:port]: {base_url!r}")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise ForbiddenURLError(
            f"engine base URL must carry no credentials, query or fragment: {base_url!r}"
        )
    prefix = parts.path.rstrip("/")
    if prefix:
        check_clean_path(prefix)
    return f"{parts.scheme}://{parts.netloc}", prefix


def guarded_url(
    base_url: str, method: str, path: str, allowlist: frozenset[tuple[str, str]]
) -> EngineEndpoint:
    """Build one URL, or raise ForbiddenURLError. The httpx result is re-checked too."""
    if (method, path) not in allowlist:
        raise ForbiddenURLError(f"{method} {path} is not an allowed engine surface")
    check_clean_path(path)
    origin, prefix = parse_base_url(base_url)
    expected = prefix + path
    url = httpx.URL(origin + expected)
    # httpx normalises dot segments; a URL that changed on the way would bypass the check.
    if url.raw_path.decode("ascii") != expected or url.query:
        raise ForbiddenURLError(f"URL changed while being built: {url}")
    return EngineEndpoint(method=method, url=url)


class EngineURLs:
    """The public surfaces of one vLLM-compatible server, one method each."""

    def __init__(self, base_url: str) -> None:
        parse_base_url(base_url)
        self.base_url = base_url

    def _endpoint(self, method: str, path: str) -> EngineEndpoint:
        return guarded_url(self.base_url, method, path, PUBLIC_SURFACES)

    def chat_completions(self) -> EngineEndpoint:
        return self._endpoint("POST", "/v1/chat/completions")

    def completions(self) -> EngineEndpoint:
        return self._endpoint("POST", "/v1/completions")

    def models(self) -> EngineEndpoint:
        return self._endpoint("GET", "/v1/models")

    def metrics(self) -> EngineEndpoint:
        return self._endpoint("GET", "/metrics")

    def health(self) -> EngineEndpoint:
        return self._endpoint("GET", "/health")

    def version(self) -> EngineEndpoint:
        return self._endpoint("GET", "/version")

    def generation(self, route: str) -> EngineEndpoint:
        """The generation endpoint for an EngineRequest route ("chat" or "completions")."""
        if route == "chat":
            return self.chat_completions()
        if route == "completions":
            return self.completions()
        raise ForbiddenURLError(f"unknown generation route {route!r}")
