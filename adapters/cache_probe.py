"""The canary probe every driver's cache control shares: one greedy, one-token,
non-streaming request of the span in a namespace, read for `cached_tokens`."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Any

from schemas.engine import EngineRequest, StreamChunk, Usage
from schemas.openai import Route


async def probe_usage(generate: Callable[[EngineRequest], AsyncGenerator[StreamChunk, None]],
                      model: str, tenant: str, salt: str, route: Route, body: dict[str, Any],
                      timeout_s: float) -> Usage | None:
    request = EngineRequest.of(f"fak-quarantine-probe-{uuid.uuid4().hex}", route,
                               {**body, "model": model, "max_tokens": 1, "temperature": 0},
                               tenant, salt)
    usage = None
    async with contextlib.aclosing(generate(request)) as chunks:
        async with asyncio.timeout(timeout_s):
            async for chunk in chunks:
                usage = chunk.usage or usage
    return usage
