"""Capabilities of a ridden vLLM: operator declarations checked by start-up probes (docs/design.md
§2, SEC-16).

Probes, all on the public surfaces: `GET /v1/models` (model id, `max_model_len`), `GET
/version`, `GET /metrics` (parses; `vllm:cache_config_info` gives the block size, the block
count and the prefix-cache hash algorithm), the KV-event endpoints (a publisher completes the
handshake; the replay ROUTER answers), the dev-mode reset route (mounted = answers GET with
405), vLLM's salt validation (an invalid salt must be refused naming `cache_salt`) and, when
prompt-token details are declared, a positive and a negative cache control under fresh salts
(policies.isolation). A hash other than SHA-256, salts not validated, a failed control, or a
declared capability whose probe fails raise CapabilityRefusedError with one line; nothing is
degraded silently. `priority_scheduling` cannot be probed (V1 silently ignores priority under
FCFS, §5), so it rests on the declaration alone. `exact_span_evict` is never true for vLLM.
The record lists what was probed and what was declared.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from policies.determinism import parse_determinism
from policies.isolation import (
    INVALID_PROBE_SALT,
    cache_control_refusal,
    hash_algo_refusal,
    salt_validation_refusal,
)
from schemas.engine import EngineCapabilities, Usage

from .control_plane import bounded_request
from .metrics import MetricsParseError, MetricsScrapeError, MetricsSnapshot, scrape
from .sse import MalformedUpstreamError, chunk_from_body
from .upstream_errors import error_from_body
from .urls import EngineEndpoint, EngineURLs

PROBE_SALT = "fak-capability-probe"


class CapabilityRefusedError(RuntimeError):
    """A declared capability failed its probe, or a required surface is missing."""


class UpstreamUnreachable(CapabilityRefusedError):
    """The probe could not reach the engine at all (connection refused, reset, timeout)."""


@dataclass(frozen=True, slots=True)
class VLLMDeclarations:
    """What the operator declares about the engine (unknown = off)."""

    priority_scheduling: bool = False
    dev_mode_reset: bool = False
    prompt_tokens_details: bool = False
    determinism: str = ""
    served_model: str | None = None
    kv_probe_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.kv_probe_timeout_s <= 0:
            raise ValueError("kv_probe_timeout_s must be positive")


class KVProbe(Protocol):
    @property
    def has_replay(self) -> bool: ...

    async def wait_connected(self, timeout_s: float) -> bool: ...

    async def probe_replay(self) -> bool: ...


class ResetRouteProbe(Protocol):
    async def probe(self) -> bool: ...


def pick_model(listing: Any, wanted: str | None) -> tuple[str, int | None]:
    """(id, max_model_len) of the wanted model, or of the only base model when none is named."""
    data = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(data, list) or not all(
        isinstance(m, dict) and isinstance(m.get("id"), str) for m in data
    ):
        raise CapabilityRefusedError("GET /v1/models did not return an OpenAI model list")
    bases = [m for m in data if m.get("parent") is None]
    chosen = [m for m in data if m["id"] == wanted] if wanted else bases
    if len(chosen) != 1:
        names = ", ".join(m["id"] for m in data)
        raise CapabilityRefusedError(f"cannot pick model {wanted or '(unnamed)'} among: {names}")
    max_len = chosen[0].get("max_model_len")
    return chosen[0]["id"], max_len if isinstance(max_len, int) and not isinstance(
        max_len, bool
    ) else None


async def _request(client: httpx.AsyncClient, endpoint: EngineEndpoint,
                   body: dict[str, Any] | None = None) -> httpx.Response:
    try:
        return await bounded_request(client, endpoint.method, endpoint.url, json=body)
    except httpx.TransportError as exc:
        # The class name only: the text can carry the upstream's address.
        raise UpstreamUnreachable(
            f"{endpoint.method} {endpoint.url.path} failed: {type(exc).__name__}") from exc
    except httpx.HTTPError as exc:
        raise CapabilityRefusedError(
            f"{endpoint.method} {endpoint.url.path} failed: {type(exc).__name__}") from exc


async def _get_json(client: httpx.AsyncClient, endpoint: EngineEndpoint) -> Any:
    response = await _request(client, endpoint)
    try:
        response.raise_for_status()
        return response.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise CapabilityRefusedError(
            f"GET {endpoint.url.path} answered {response.status_code}, not JSON") from exc


async def _get_version(client: httpx.AsyncClient, urls: EngineURLs) -> str:
    body = await _get_json(client, urls.version())
    version = body.get("version") if isinstance(body, dict) else None
    if not isinstance(version, str) or not version:
        raise CapabilityRefusedError("GET /version did not answer {\"version\": \"<x.y.z>\"}")
    return version


async def _complete(client: httpx.AsyncClient, urls: EngineURLs, model: str, prompt: str,
                    salt: str) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
            "cache_salt": salt}
    return await _request(client, urls.completions(), body)


async def _probe_salt_validation(client: httpx.AsyncClient, urls: EngineURLs,
                                 model: str) -> str:
    response = await _complete(client, urls, model, "probe", INVALID_PROBE_SALT)
    error = error_from_body(response.status_code, response.content)
    refusal = salt_validation_refusal(response.status_code, error.param, error.message)
    if refusal:
        raise CapabilityRefusedError(refusal)
    return (f"cache_salt: the invalid salt {INVALID_PROBE_SALT!r} was refused "
            f"({response.status_code}, param {error.param})")


async def _usage(client: httpx.AsyncClient, urls: EngineURLs, model: str, prompt: str,
                 salt: str) -> Usage | None:
    response = await _complete(client, urls, model, prompt, salt)
    if response.status_code != 200:
        raise CapabilityRefusedError(
            f"a cache-control probe completion answered {response.status_code}")
    try:
        return chunk_from_body(response.content).usage
    except MalformedUpstreamError as exc:
        raise CapabilityRefusedError(f"a cache-control probe answered garbage: {exc}") from exc


async def _probe_cache_controls(client: httpx.AsyncClient, urls: EngineURLs, model: str,
                                block_size: int, max_model_len: int | None) -> str:
    """Same prompt twice under one fresh salt (must hit), then under another (must not)."""
    words = 2 * block_size + 2
    if max_model_len:
        words = min(words, max_model_len // 2)
    prompt = " ".join(["probe"] * words)
    salt_a, salt_b = (f"{PROBE_SALT}-{uuid.uuid4().hex}" for _ in range(2))
    readings = []
    for salt in (salt_a, salt_a, salt_b):
        usage = await _usage(client, urls, model, prompt, salt)
        readings.append(None if usage is None else usage.cached_tokens)
    refusal = cache_control_refusal(*readings)
    if refusal:
        raise CapabilityRefusedError(refusal)
    return (f"cache_salt: same salt repeat hit {readings[1]} cached tokens, a fresh salt "
            f"{readings[2]}")


async def _probe_kv(kv: KVProbe, timeout_s: float) -> tuple[bool, bool]:
    if not await kv.wait_connected(timeout_s):
        raise CapabilityRefusedError(
            f"KV-event endpoint configured but no publisher connected within {timeout_s}s"
        )
    if kv.has_replay and not await kv.probe_replay():
        raise CapabilityRefusedError("KV replay endpoint configured but the ROUTER did not answer")
    return True, kv.has_replay


async def _scrape_cache_config(client: httpx.AsyncClient, urls: EngineURLs) -> MetricsSnapshot:
    try:
        snapshot = await scrape(client, urls)
    except MetricsScrapeError as exc:
        if isinstance(exc.__cause__, httpx.TransportError):
            raise UpstreamUnreachable(f"/metrics probe failed: {exc}") from exc
        raise CapabilityRefusedError(f"/metrics probe failed: {exc}") from exc
    except MetricsParseError as exc:
        raise CapabilityRefusedError(f"/metrics probe failed: {exc}") from exc
    refusal = hash_algo_refusal([c.prefix_caching_hash_algo for c in snapshot.cache_config])
    if refusal:
        raise CapabilityRefusedError(refusal)
    return snapshot


def _declared(declared: VLLMDeclarations) -> tuple[str, ...]:
    names = {"priority_scheduling": declared.priority_scheduling,
             "prefix_reset": declared.dev_mode_reset,
             "cached_tokens_in_usage": declared.prompt_tokens_details,
             "determinism": bool(declared.determinism),
             "model_id": declared.served_model is not None}
    return tuple(name for name, on in names.items() if on)


async def probe_capabilities(
    client: httpx.AsyncClient,
    urls: EngineURLs,
    declared: VLLMDeclarations,
    kv: KVProbe | None = None,
    reset_route: ResetRouteProbe | None = None,
    metrics_urls: EngineURLs | None = None,
) -> EngineCapabilities:
    """Probe the engine and combine with the declarations; raise on any failed declaration
    or isolation fact. `/metrics` is read at `metrics_urls` when the engine exports it
    elsewhere."""
    listing = await _get_json(client, urls.models())
    model_id, max_model_len = pick_model(listing, declared.served_model)
    version = await _get_version(client, urls)
    snapshot = await _scrape_cache_config(client, metrics_urls or urls)
    cache = snapshot.cache_config[0]
    probed = ["model_id", "max_model_len", "engine_version", "prefix_caching_hash_algo"]
    probed += [name for name, value in (("block_size", snapshot.block_size),
                                        ("num_blocks", cache.num_blocks)) if value is not None]
    kv_events, kv_replay = (
        await _probe_kv(kv, declared.kv_probe_timeout_s) if kv else (False, False)
    )
    probed += [name for name, on in (("kv_events", kv_events), ("kv_replay", kv_replay)) if on]
    if declared.dev_mode_reset:
        if reset_route is None or not await reset_route.probe():
            raise CapabilityRefusedError(
                "dev-mode reset declared but POST /reset_prefix_cache is not mounted"
            )
        probed.append("prefix_reset")
    notes = [f"prefix cache: {cache.prefix_caching_hash_algo}, "
             f"{cache.num_blocks} blocks of {snapshot.block_size}"]
    notes.append(await _probe_salt_validation(client, urls, model_id))
    probed.append("cache_salt")
    if declared.prompt_tokens_details:
        notes.append(await _probe_cache_controls(client, urls, model_id,
                                                 snapshot.block_size or 16, max_model_len))
        probed.append("cached_tokens_in_usage")
    else:
        notes.append("cache controls not run: prompt-token details not declared")
    if declared.priority_scheduling:
        notes.append("priority_scheduling rests on the operator declaration (not probeable)")
    return EngineCapabilities(
        engine_kind="vllm",
        model_id=model_id,
        max_model_len=max_model_len,
        block_size=snapshot.block_size,
        cache_salt=True,
        priority_scheduling=declared.priority_scheduling,
        exact_span_evict=False,
        prefix_reset=declared.dev_mode_reset,
        kv_events=kv_events,
        kv_replay=kv_replay,
        cached_tokens_in_usage=declared.prompt_tokens_details,
        determinism=parse_determinism(declared.determinism),
        engine_version=version,
        prefix_caching_hash_algo=cache.prefix_caching_hash_algo,
        num_blocks=cache.num_blocks,
        probed=tuple(probed),
        declared=_declared(declared),
        notes=tuple(notes),
    )
