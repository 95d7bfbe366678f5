"""What the fleet knows about each upstream and each of its ranks, as plain counters.

Invariants (`Upstream.check_integrity`): one Member per rank 0..data_parallel_size-1, each
pointing back at its upstream; counters never negative; an upstream that is up has passed
a probe since it was last down (`probed_at >= down_since`); a member's failovers and
logged failures never exceed its failures.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from adapters.vllm.http_driver import VLLMDriver
from adapters.vllm.kv_subscriber import SyncState
from adapters.vllm.upstream_errors import UPSTREAM_UNAVAILABLE, EngineNotReached
from schemas.engine import EngineCapabilities, EngineError

FAILURE_LOG_EVERY_S = 10.0

log = logging.getLogger("fak.fleet")


@dataclass(eq=False)
class Member:
    """One (upstream, rank) the router can pick."""

    upstream: Upstream
    rank: int
    in_flight: int = 0
    engine_load: float | None = None
    decisions: int = 0
    failovers: int = 0
    failures: int = 0  # requests that failed here before their first byte, retried or not
    last_failure: str | None = None
    failures_logged: int = 0  # `failures` when the last warning was logged, and when
    failure_logged_at: float = float("-inf")
    predictions: int = 0
    exact_predictions: int = 0
    predicted_tokens: int = 0
    cached_tokens: int = 0
    last_routed_at: float | None = None

    @property
    def name(self) -> str:
        return f"{self.upstream.name}/{self.rank}"

    @property
    def rank_header(self) -> int | None:
        """The `X-data-parallel-rank` value to send (none on a single-rank upstream)."""
        return self.rank if self.upstream.data_parallel_size > 1 else None

    def sync_state(self) -> SyncState | None:
        kv = self.upstream.driver.kv
        return None if kv is None else kv.state(self.rank)

    def note_failure(self, exc: EngineError, fallback: Member | None) -> None:
        """Count a failure before the first byte here and log it: at most one line per
        member per FAILURE_LOG_EVERY_S (a dead or overloaded engine fails every request
        sent to it), with how many failed since the last line."""
        self.failures += 1
        self.last_failure = exc.message
        now = time.monotonic()
        if now - self.failure_logged_at < FAILURE_LOG_EVERY_S:
            return
        log.warning("%d request(s) failed on %s before the first byte, the last with %d %s "
                    "(%s)", self.failures - self.failures_logged, self.name, exc.status,
                    exc.message, "not retried" if fallback is None else
                    f"retried on {fallback.name}")
        self.failures_logged, self.failure_logged_at = self.failures, now

    def record_prediction(self, predicted: int, actual: int | None) -> None:
        if actual is None:
            return
        self.predictions += 1
        self.exact_predictions += predicted == actual
        self.predicted_tokens += predicted
        self.cached_tokens += actual

    def view(self) -> dict[str, Any]:
        kv = self.upstream.driver.kv
        state = self.sync_state()
        return {"rank": self.rank, "sync_state": None if state is None else state.value,
                "index_blocks": None if kv is None else len(kv.index(self.rank)),
                "in_flight": self.in_flight, "engine_load": self.engine_load,
                "decisions": self.decisions, "failovers": self.failovers,
                "failures": self.failures, "last_failure": self.last_failure,
                "predictions": self.predictions, "exact_predictions": self.exact_predictions,
                "predicted_cached_tokens": self.predicted_tokens,
                "cached_tokens": self.cached_tokens}


@dataclass(eq=False)
class Upstream:
    """One server of the fleet: its driver (HTTP, KV subscriber, control plane) and health."""

    name: str
    driver: VLLMDriver
    data_parallel_size: int = 1
    up: bool = False
    refusal: str | None = None
    down_since: float = 0.0
    probed_at: float | None = None
    checks: int = 0
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    members: list[Member] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.members = [Member(self, rank) for rank in range(self.data_parallel_size)]

    def mark_down(self, now: float, reason: str | None = None) -> None:
        """Down (its driver re-probes before its next request); logged once per outage,
        by whichever path saw it first: a health check or a request's lost connection."""
        if self.up:
            self.down_since = now
            log.warning("upstream %s is down: %s", self.name, reason or self.refusal)
        self.up = False
        self.refusal = reason or self.refusal
        self.driver.mark_reconnect()
        self.wake.set()

    def mark_up(self, now: float) -> None:
        self.up, self.refusal = True, None
        self.probed_at = now

    def set_loads(self, loads: dict[str, float] | None) -> None:
        for member in self.members:
            member.engine_load = None if loads is None else loads.get(str(member.rank))

    def view(self) -> dict[str, Any]:
        caps: EngineCapabilities = self.driver.capabilities
        return {"name": self.name, "base_url": self.driver.config.base_url, "up": self.up,
                "refusal": self.refusal, "data_parallel_size": self.data_parallel_size,
                "probes": self.driver.probes, "capabilities": asdict(caps),
                "ranks": [m.view() for m in self.members]}

    def check_integrity(self) -> None:
        assert [m.rank for m in self.members] == list(range(self.data_parallel_size))
        for m in self.members:
            assert m.upstream is self
            assert min(m.in_flight, m.decisions, m.predictions, m.failovers) >= 0
            assert m.failovers <= m.failures and m.failures_logged <= m.failures
            assert m.exact_predictions <= m.predictions
        if self.up:
            assert self.probed_at is not None and self.probed_at >= self.down_since


def retryable(exc: EngineError) -> bool:
    """Before the first byte, a refused/broken connection or any 5xx may go elsewhere."""
    return exc.status >= 500


def connection_lost(exc: EngineError) -> bool:
    """The upstream could not be reached (refused, the connect timed out, held back by
    its driver until a re-probe passes) or its connection broke (502 from the transport):
    its other ranks are gone too."""
    return isinstance(exc, EngineNotReached) or (
        exc.status == 502 and exc.type == UPSTREAM_UNAVAILABLE)
