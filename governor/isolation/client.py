"""A streaming OpenAI-compatible client that measures one request's time to first token.

TTFT is taken on the client's monotonic clock from just before the request is written to
the arrival of the first SSE event that carries a token (non-empty text or content) or a
finish reason — keep-alive comments and role-only chat deltas do not count. The stream is
then read to its end, so the connection is reused and the next request starts clean. One
connection per key (each `TtftClient`), kept alive across requests, so no TCP or TLS set-up
falls inside a measurement.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from governor.isolation.config import Route

PATHS: dict[Route, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
MAX_RETRIES_429 = 5


class EndpointError(Exception):
    """The endpoint refused a request or broke the stream; the message says how."""


@dataclass(frozen=True, slots=True)
class Timed:
    """One measured request: TTFT in seconds, and what the usage chunk said (None if the
    endpoint sent none)."""

    ttft_s: float
    prompt_tokens: int | None
    cached_tokens: int | None


class TtftClient:
    def __init__(self, base_url: str, key: str, label: str, timeout_s: float,
                 model: str | None, route: Route) -> None:
        self.label = label
        self.model = model
        self.route = route
        self._http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout_s,
                                  headers={"Authorization": f"Bearer {key}"}, trust_env=False,
                                  limits=httpx.Limits(max_connections=1))

    def close(self) -> None:
        self._http.close()

    def first_model(self) -> str:
        """The first model `/v1/models` lists (the audit's default model)."""
        try:
            response = self._http.get("/v1/models")
        except httpx.HTTPError as exc:
            raise EndpointError(f"key {self.label}: GET /v1/models: {exc!r}") from exc
        _raise_for_status(response, self.label)
        try:
            return str(response.json()["data"][0]["id"])
        except (ValueError, KeyError, IndexError, TypeError):
            raise EndpointError(f"key {self.label}: /v1/models lists no model") from None

    def body(self, prompt: str) -> dict[str, Any]:
        body: dict[str, Any] = {"max_tokens": 1, "temperature": 0, "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.model is not None:
            body["model"] = self.model
        if self.route == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        return body

    def measure(self, prompt: str) -> Timed:
        """One request, `max_tokens=1`; a 429 is retried after its Retry-After."""
        body = self.body(prompt)
        for _ in range(MAX_RETRIES_429):
            try:
                timed = self._once(body)
            except httpx.HTTPError as exc:
                raise EndpointError(f"key {self.label}: {exc!r}") from exc
            if isinstance(timed, Timed):
                return timed
            time.sleep(timed)
        raise EndpointError(f"key {self.label}: still rate limited after "
                            f"{MAX_RETRIES_429} tries")

    def _once(self, body: dict[str, Any]) -> Timed | float:
        """The measurement, or the seconds to wait before a retry (HTTP 429)."""
        first: float | None = None
        usage: dict[str, Any] | None = None
        start = time.perf_counter()
        with self._http.stream("POST", PATHS[self.route], json=body) as response:
            if response.status_code == 429:
                response.read()
                return _retry_after(response)
            if response.status_code != 200:
                response.read()
                _raise_for_status(response, self.label)
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = _event(data, self.label)
                if first is None and _has_token(event):
                    first = time.perf_counter()
                if isinstance(event.get("usage"), dict):
                    usage = event["usage"]
        if first is None:
            raise EndpointError(f"key {self.label}: the stream ended without a token")
        return Timed(first - start, *_usage_counts(usage))


def _event(data: str, label: str) -> dict[str, Any]:
    try:
        event = json.loads(data)
    except ValueError:
        raise EndpointError(f"key {label}: a stream event is not JSON: {data[:80]!r}") from None
    if not isinstance(event, dict):
        raise EndpointError(f"key {label}: a stream event is not an object")
    if "error" in event:
        raise EndpointError(f"key {label}: error in the stream: {_message(event)}")
    return event


def _has_token(event: dict[str, Any]) -> bool:
    for choice in event.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        content = delta.get("content") if isinstance(delta, dict) else None
        if choice.get("text") or content or choice.get("finish_reason"):
            return True
    return False


def _usage_counts(usage: dict[str, Any] | None) -> tuple[int | None, int | None]:
    if usage is None:
        return None, None
    prompt = usage.get("prompt_tokens")
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return (prompt if isinstance(prompt, int) else None,
            cached if isinstance(cached, int) else None)


def _retry_after(response: httpx.Response) -> float:
    try:
        return min(60.0, max(0.0, float(response.headers.get("Retry-After", "1"))))
    except ValueError:
        return 1.0


def _message(answer: Any) -> str:
    if isinstance(answer, dict) and isinstance(answer.get("error"), dict):
        return str(answer["error"].get("message"))[:200]
    return str(answer)[:200]


def _raise_for_status(response: httpx.Response, label: str) -> None:
    if response.status_code == 200:
        return
    try:
        answer: Any = response.json()
    except ValueError:
        answer = response.text
    raise EndpointError(f"key {label}: {response.request.method} {response.request.url.path}: "
                        f"HTTP {response.status_code}: {_message(answer)}")
