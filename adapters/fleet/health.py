"""Per-upstream health: one watcher task each, probing with backoff.

A check: `/health` and, whenever the upstream was seen down, reconnected or restarted (a
KV seq that went back, or a `/version` that changed), a full capability re-probe
(`VLLMDriver.ready` → `ensure_probed`); the re-probed capabilities must still fit the
fleet's (adapters/fleet/capabilities.py); then one `/metrics` scrape for the ranks' loads
(their gauges alone are parsed: the check runs on the loop that relays generation).
Pass → up. Fail → down, and the next check comes after a doubling backoff (from
`interval_s` up to `backoff_max_s`); a request that finds the connection lost marks the
upstream down and wakes its watcher at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from schemas.engine import EngineCapabilities, EngineError

from .capabilities import incompatibility
from .state import Upstream

log = logging.getLogger("fak.fleet")


@dataclass(frozen=True, slots=True)
class HealthConfig:
    interval_s: float = 1.0
    backoff_max_s: float = 10.0
    check_timeout_s: float = 150.0

    def __post_init__(self) -> None:
        if not 0 < self.interval_s <= self.backoff_max_s or self.check_timeout_s <= 0:
            raise ValueError("need 0 < interval_s <= backoff_max_s and check_timeout_s > 0")


class HealthWatch:
    def __init__(self, upstreams: Sequence[Upstream], fleet: EngineCapabilities,
                 config: HealthConfig) -> None:
        self.upstreams, self.fleet, self.config = tuple(upstreams), fleet, config
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._watch(u), name=f"fleet-health-{u.name}")
                       for u in self.upstreams]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    async def _watch(self, upstream: Upstream) -> None:
        delay = self.config.interval_s
        while True:
            upstream.wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await upstream.wake.wait()
            ok = await self.check(upstream)
            delay = self.config.interval_s if ok else min(
                max(delay, self.config.interval_s / 2) * 2, self.config.backoff_max_s)

    async def check(self, upstream: Upstream) -> bool:
        """One health check; updates the upstream's state and returns whether it is up."""
        upstream.checks += 1
        was_up = upstream.up
        try:
            async with asyncio.timeout(self.config.check_timeout_s):
                reason = await self._problem(upstream, was_up)
        except (TimeoutError, EngineError, OSError) as exc:
            reason = f"health check failed: {type(exc).__name__}"
        now = time.monotonic()
        if reason is None:
            if not was_up:
                log.info("upstream %s is up (probed)", upstream.name)
                upstream.mark_up(now)
            return True
        upstream.mark_down(now, reason)
        return False

    async def _problem(self, upstream: Upstream, was_up: bool) -> str | None:
        driver = upstream.driver
        if was_up and await driver.version_changed():
            log.warning("upstream %s changed version: re-probing", upstream.name)
        if not await driver.ready():  # health, then the re-probe if one is due
            return driver.refusal or "not healthy"
        mismatch = incompatibility(self.fleet, driver.capabilities)
        if mismatch:
            driver.mark_reconnect()
            return f"refused after re-probe: {mismatch}"
        upstream.set_loads(await driver.engine_loads())
        return None
