"""Opt-in dev-mode control client: `POST /reset_prefix_cache` and nothing else (docs/design.md §1).

Only for an engine the operator declares runs with `VLLM_SERVER_DEV_MODE=1`; off by default
(`enabled=False` refuses every call before a socket opens). It has its own allowlist of one
path, and every call — refused, failed or not — is handed to the audit callback.

Replies (docs/reference/vllm-surfaces.md §4): 0.32.0 answers 200 `{"success": true|false}` (false
while a
generation runs) → SUCCEEDED / FAILED; older releases answer 200 with an empty body even when
the reset failed → UNKNOWN. Any other status is FAILED (404 = dev mode is off).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from schemas.cache_control import ResetOutcome, ResetResult

from .control_plane import bounded_request
from .upstream_errors import timed_out, unavailable
from .urls import EngineEndpoint, guarded_url

RESET_PATH = "/reset_prefix_cache"
DEV_SURFACES: frozenset[tuple[str, str]] = frozenset({("POST", RESET_PATH), ("GET", RESET_PATH)})
"""GET only probes, without effect: an existing POST route answers it 405, a missing one 404."""


class DevControlDisabledError(RuntimeError):
    """The dev-mode control client was used without being enabled."""


@dataclass(frozen=True, slots=True)
class DevControlConfig:
    base_url: str
    enabled: bool = False
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        guarded_url(self.base_url, "POST", RESET_PATH, DEV_SURFACES)
        if self.timeout_s <= 0:
            raise ValueError("timeout_s must be positive")


@dataclass(frozen=True, slots=True)
class DevControlCall:
    """One audited call: what was asked, and what came of it."""

    action: str
    url: str
    outcome: ResetOutcome | None
    status: int | None
    detail: str
    started_at: float
    elapsed_s: float


def dev_endpoint(base_url: str, method: str) -> EngineEndpoint:
    """The one constructor of dev-mode URLs."""
    return guarded_url(base_url, method, RESET_PATH, DEV_SURFACES)


def outcome_of(status: int, body: bytes) -> ResetOutcome:
    if status != 200:
        return ResetOutcome.FAILED
    if not body.strip():
        return ResetOutcome.UNKNOWN
    try:
        success = json.loads(body).get("success")
    except (ValueError, AttributeError, UnicodeDecodeError):
        return ResetOutcome.UNKNOWN
    if success is True:
        return ResetOutcome.SUCCEEDED
    return ResetOutcome.FAILED if success is False else ResetOutcome.UNKNOWN


class VLLMDevControl:
    """The dev-mode control client; `audit` receives a DevControlCall for every call."""

    def __init__(self, config: DevControlConfig, audit: Callable[[DevControlCall], None]) -> None:
        self.config = config
        self._audit = audit

    async def reset_prefix_cache(self) -> ResetResult:
        """Reset vLLM's prefix cache. FAILED/UNKNOWN are results; transport errors raise."""
        response = await self._call("reset_prefix_cache", "POST")
        outcome = outcome_of(response.status_code, response.content)
        return ResetResult(outcome, response.status_code, response.text)

    async def probe(self) -> bool:
        """True when the reset route is mounted (dev mode on), without resetting anything."""
        response = await self._call("probe_reset_route", "GET")
        return response.status_code == 405

    async def _call(self, action: str, method: str) -> httpx.Response:
        endpoint = dev_endpoint(self.config.base_url, method)
        started, clock = time.time(), time.monotonic()

        def audit(outcome: ResetOutcome | None, status: int | None, detail: str) -> None:
            self._audit(
                DevControlCall(
                    action,
                    str(endpoint.url),
                    outcome,
                    status,
                    detail,
                    started,
                    time.monotonic() - clock,
                )
            )

        if not self.config.enabled:
            audit(None, None, "refused: dev-mode control is not enabled")
            raise DevControlDisabledError(
                "dev-mode control client is disabled (declare dev mode to enable)"
            )
        try:
            async with httpx.AsyncClient(timeout=self.config.timeout_s, trust_env=False) as client:
                response = await bounded_request(client, endpoint.method, endpoint.url)
        except httpx.TimeoutException as exc:
            audit(None, None, f"timeout: {exc!r}")
            raise timed_out(f"{method} {endpoint.url}") from exc
        except httpx.HTTPError as exc:
            audit(None, None, f"transport error: {exc!r}")
            raise unavailable(f"{method} {endpoint.url}: {exc!r}") from exc
        outcome = outcome_of(response.status_code, response.content) if method == "POST" else None
        audit(outcome, response.status_code, response.text[:200])
        return response
