"""The streaming client, timed as `vllm bench serve` times it (vllm/benchmarks/lib/
endpoint_request_func.py, docs/reference/benchmarking.md §1):

- `st` = perf_counter just before the POST (after any wait for a concurrency slot);
- TTFT = the first SSE message whose `choices` is non-empty (its text may be empty);
- ITL = gaps between successive choices-bearing messages (per chunk, not per token);
- E2EL (`latency`) = the last choices-bearing message − st;
- output tokens = `usage.completion_tokens` of the final usage chunk;
- success = HTTP 200 and at least one choices chunk; SSE comments (`:`) are skipped.

Also kept: `usage.prompt_tokens` and `usage.prompt_tokens_details.cached_tokens` (None when
the server does not report it), which the cache-state check needs.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from governor.bench.workloads import PlannedRequest

ERROR_CHARS = 300
# An idle pooled connection is dropped after this long, before the engine's own idle timeout
# (uvicorn's 5 s under vLLM) can close it as a block's first requests are sent on it: an
# arm left idle while the others ran lost them as "Server disconnected".
KEEPALIVE_S = 4.0


@dataclass(slots=True)
class RequestResult:
    """One request's measurements, seconds on the client's perf_counter."""

    prompt_len: int
    success: bool = False
    start_time: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    output_tokens: int = 0
    cached_tokens: int | None = None
    client_queue_time: float = 0.0
    generated_text: str = ""
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def completion_payload(model: str, request: PlannedRequest, stream: bool = True
                       ) -> dict[str, Any]:
    """vLLM bench serve's completions payload, greedy, with ignore_eos so every arm does
    the same amount of decoding."""
    body: dict[str, Any] = {"model": model, "prompt": request.prompt,
                            "max_tokens": request.output_len, "temperature": 0,
                            "repetition_penalty": 1.0, "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _apply_usage(result: RequestResult, usage: dict[str, Any]) -> None:
    if isinstance(usage.get("completion_tokens"), int):
        result.output_tokens = usage["completion_tokens"]
    if isinstance(usage.get("prompt_tokens"), int):
        result.prompt_len = usage["prompt_tokens"]
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    result.cached_tokens = cached if isinstance(cached, int) else None


def _on_message(result: RequestResult, data: dict[str, Any], last: float, st: float) -> float:
    """Apply one SSE JSON message; returns the time of the latest choices message."""
    choices = data.get("choices")
    if choices:
        now = time.perf_counter()
        if result.ttft == 0.0:
            result.ttft = now - st
        else:
            result.itl.append(now - last)
        result.generated_text += choices[0].get("text") or ""
        last = now
    elif isinstance(data.get("usage"), dict):
        _apply_usage(result, data["usage"])
    if isinstance(data.get("error"), dict):
        result.error = json.dumps(data["error"])[:ERROR_CHARS]
    return last


async def stream_completion(session: aiohttp.ClientSession, url: str, model: str,
                            request: PlannedRequest, headers: dict[str, str]) -> RequestResult:
    """POST `url`/v1/completions streaming; never raises for a failed request."""
    result = RequestResult(prompt_len=len(request.prompt_ids))
    st = time.perf_counter()
    result.start_time = st
    last = st
    try:
        async with session.post(f"{url}/v1/completions", headers=headers,
                                json=completion_payload(model, request)) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:ERROR_CHARS]}"
                return result
            async for raw in response.content:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue  # blank separators and SSE comments
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                last = _on_message(result, json.loads(payload), last, st)
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError, UnicodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:ERROR_CHARS]
        return result
    result.latency = last - st
    result.success = result.ttft > 0 and not result.error
    if result.ttft == 0 and not result.error:
        result.error = "no choices chunk arrived (TTFT undefined)"
    return result


async def complete_once(session: aiohttp.ClientSession, url: str, model: str,
                        request: PlannedRequest, headers: dict[str, str]) -> RequestResult:
    """POST non-streaming; latency = the whole answer. Never raises for a failed request."""
    result = RequestResult(prompt_len=len(request.prompt_ids))
    st = time.perf_counter()
    result.start_time = st
    try:
        async with session.post(f"{url}/v1/completions", headers=headers,
                                json=completion_payload(model, request, stream=False)
                                ) as response:
            body = await response.read()
            result.latency = time.perf_counter() - st
            if response.status != 200:
                result.error = f"HTTP {response.status}: {body[:ERROR_CHARS]!r}"
                return result
            data = json.loads(body)
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:ERROR_CHARS]
        return result
    if isinstance(data.get("usage"), dict):
        _apply_usage(result, data["usage"])
    choices = data.get("choices") or [{}]
    result.generated_text = choices[0].get("text") or ""
    result.ttft = result.latency
    result.success = bool(data.get("choices"))
    return result


def open_session(concurrency: int, timeout_s: float) -> aiohttp.ClientSession:
    """One session per arm: a connection pool as large as the level needs; no proxies from
    the environment (loopback benchmarks must not leave the machine)."""
    connector = aiohttp.TCPConnector(limit=concurrency + 8, keepalive_timeout=KEEPALIVE_S)
    return aiohttp.ClientSession(connector=connector, trust_env=False,
                                 timeout=aiohttp.ClientTimeout(total=timeout_s))
