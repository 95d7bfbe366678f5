"""Capabilities of a ridden vLLM: operator declarations checked by start-up probes (docs/design.md
§2).

Probes: `GET /v1/models` (model id, `max_model_len`), `GET /metrics` (parses; block size from
`vllm:cache_config_info`), the KV-event endpoints (a publisher completes
the handshake; the replay ROUTER answers), the dev-mode reset route (mounted = answers GET
with 405), and prompt-token details (a one-token probe completion reports
`prompt_tokens_details`). A declared or configured capability whose probe fails raises
CapabilityRefusedError; nothing is degraded silently. `priority_scheduling` cannot be probed
(V1 silently ignores priority under FCFS, §5), so it rests on the declaration alone.
`exact_span_evict` is never true for vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from policies.determinism import parse_determinism
from schemas.engine import EngineCapabilities

from .metrics import MetricsParseError, MetricsScrapeError, scrape
from .sse import MalformedUpstreamError, chunk_from_body
from .urls import EngineURLs

PROBE_SALT = "fak-capability-probe"


class CapabilityRefusedError(RuntimeError):
    """A declared capability failed its probe, or a required surface is missing."""


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
    has_replay: bool

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


async def _get_models(client: httpx.AsyncClient, urls: EngineURLs) -> Any:
    endpoint = urls.models()
    try:
        response = await client.request(endpoint.method, endpoint.url)
        response.raise_for_status()
        return response.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise CapabilityRefusedError(f"GET {endpoint.url} failed: {exc!r}") from exc


async def _probe_prompt_details(client: httpx.AsyncClient, urls: EngineURLs, model: str) -> bool:
    endpoint = urls.completions()
    body = {
        "model": model,
        "prompt": "probe",
        "max_tokens": 1,
        "temperature": 0,
        "cache_salt": PROBE_SALT,
    }
    try:
        response = await client.request(endpoint.method, endpoint.url, json=body)
        usage = chunk_from_body(response.content).usage if response.status_code == 200 else None
    except (httpx.HTTPError, MalformedUpstreamError):
        return False
    return usage is not None and usage.cached_tokens is not None


async def _probe_kv(kv: KVProbe, timeout_s: float) -> tuple[bool, bool]:
    if not await kv.wait_connected(timeout_s):
        raise CapabilityRefusedError(
            f"KV-event endpoint configured but no publisher connected within {timeout_s}s"
        )
    if kv.has_replay and not await kv.probe_replay():
        raise CapabilityRefusedError("KV replay endpoint configured but the ROUTER did not answer")
    return True, kv.has_replay


async def probe_capabilities(
    client: httpx.AsyncClient,
    urls: EngineURLs,
    declared: VLLMDeclarations,
    kv: KVProbe | None = None,
    reset_route: ResetRouteProbe | None = None,
) -> EngineCapabilities:
    """Probe the engine and combine with the declarations; raise on any failed declaration."""
    model_id, max_model_len = pick_model(await _get_models(client, urls), declared.served_model)
    try:
        snapshot = await scrape(client, urls)
    except (MetricsScrapeError, MetricsParseError) as exc:
        raise CapabilityRefusedError(f"/metrics probe failed: {exc}") from exc
    kv_events, kv_replay = (
        await _probe_kv(kv, declared.kv_probe_timeout_s) if kv else (False, False)
    )
    if declared.dev_mode_reset and (reset_route is None or not await reset_route.probe()):
        raise CapabilityRefusedError(
            "dev-mode reset declared but POST /reset_prefix_cache is not mounted"
        )
    if declared.prompt_tokens_details and not await _probe_prompt_details(client, urls, model_id):
        raise CapabilityRefusedError(
            "prompt-token details declared but a probe completion carried no "
            "usage.prompt_tokens_details.cached_tokens "
            "(start vLLM with --enable-prompt-tokens-details)"
        )
    notes = (
        ["priority_scheduling rests on the operator declaration (not probeable)"]
        if declared.priority_scheduling
        else []
    )
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
        notes=tuple(notes),
    )
