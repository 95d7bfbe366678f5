"""The URL constructors never emit a path outside the allowlist (docs/design.md §1)."""

from __future__ import annotations

import inspect

import pytest

from adapters.vllm import dev_control
from adapters.vllm.dev_control import DEV_SURFACES, dev_endpoint
from adapters.vllm.urls import (
    FORBIDDEN_MARKERS,
    PUBLIC_SURFACES,
    EngineEndpoint,
    EngineURLs,
    ForbiddenURLError,
    fully_decoded,
    guarded_url,
)

BASES = ["http://127.0.0.1:8000", "http://engine:8000/", "https://gpu-7.internal-net:443/vllm"]


def emitted(base: str) -> list[EngineEndpoint]:
    """Every endpoint every public constructor can build."""
    urls = EngineURLs(base)
    out = [dev_endpoint(base, "POST"), dev_endpoint(base, "GET")]
    for name, method in inspect.getmembers(urls, inspect.ismethod):
        if name.startswith("_"):
            continue
        params = inspect.signature(method).parameters
        out += [method("chat"), method("completions")] if params else [method()]
    return out


def path_of(endpoint: EngineEndpoint, base: str) -> str:
    prefix = base.split("://", 1)[1].partition("/")[2].rstrip("/")
    path = endpoint.url.raw_path.decode()
    assert path.startswith("/" + prefix if prefix else "/")
    return path[len(prefix) + 1 :] if prefix else path


@pytest.mark.parametrize("base", BASES)
def test_every_emitted_path_is_allowed_and_clean(base: str) -> None:
    endpoints = emitted(base)
    assert len(endpoints) >= 9
    for endpoint in endpoints:
        path = path_of(endpoint, base)
        assert (endpoint.method, path) in PUBLIC_SURFACES | DEV_SURFACES
        decoded = fully_decoded(endpoint.url.raw_path.decode()).lower()
        assert not any(marker in decoded for marker in FORBIDDEN_MARKERS)
        assert not endpoint.url.query and not endpoint.url.fragment


def test_dev_surface_is_only_the_reset_route() -> None:
    assert {p for _, p in DEV_SURFACES} == {dev_control.RESET_PATH}
    assert not PUBLIC_SURFACES & DEV_SURFACES


ATTACKS = [
    "/v1/../admin",
    "/v1/models/..",
    "/v1/%2e%2e/admin",
    "/v1/%252e%252e/admin",
    "/v1/models%2f..%2fdebug",
    "/internal/stats",
    "/Debug",
    "/%61dmin",
    "/v1/models\\..\\admin",
    "/private",
    "/v1/models?x=1",
    "/v1/models#frag",
    "/v1/models%00",
    "/v1/%25%32%65%25%32%65/admin",
]


@pytest.mark.parametrize("path", ATTACKS)
def test_forbidden_paths_refused_even_if_allowlisted(path: str) -> None:
    # A mis-edited allowlist still cannot let these out: the marker check runs regardless.
    with pytest.raises(ForbiddenURLError):
        guarded_url("http://engine:8000", "GET", path, frozenset({("GET", path)}))


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/completions"),
        ("POST", "/v1/models"),
        ("GET", "/reset_prefix_cache"),
        ("POST", "/sleep"),
        ("GET", "/server_info"),
        ("POST", "/collective_rpc"),
        ("GET", "/kv_event_sources"),
    ],
)
def test_paths_outside_the_allowlist_refused(method: str, path: str) -> None:
    with pytest.raises(ForbiddenURLError):
        guarded_url("http://engine:8000", method, path, PUBLIC_SURFACES)


@pytest.mark.parametrize(
    "base",
    [
        "ftp://engine",
        "http://user:pw@engine",
        "http://engine/?q=1",
        "http://engine/#x",
        "http:///x",
        "http://engine/../admin",
        "http://engine/%2e%2e",
        "http://engine/admin",
    ],
)
def test_bad_base_urls_refused(base: str) -> None:
    with pytest.raises(ForbiddenURLError):
        EngineURLs(base)


def test_unknown_route_refused() -> None:
    with pytest.raises(ForbiddenURLError):
        EngineURLs("http://engine").generation("embeddings")
