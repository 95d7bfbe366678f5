"""SSE events and response bodies from vLLM as `StreamChunk`s (docs/reference/vllm-surfaces.md
§1.5-1.6).

The SSE framing itself is parsed by httpx-sse; this module only turns each event's data into
a chunk, unchanged: the role-only first chunk, content chunks, the usage chunk
(`choices: []`), an in-stream `{"error": ...}` event and `[DONE]` are all relayed one to one.
"""

from __future__ import annotations

import json
from typing import Any

from schemas.engine import StreamChunk, Usage

DONE_MARKER = "[DONE]"


class MalformedUpstreamError(ValueError):
    """The engine sent something that is not the OpenAI shape it promised."""


def _count(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise MalformedUpstreamError(f"usage.{name} is not a non-negative integer: {value!r}")
    return value


def usage_from(payload: dict[str, Any]) -> Usage | None:
    """Usage of a response or chunk; cached_tokens None when the engine did not report it."""
    usage = payload.get("usage")
    if usage is None:
        return None
    if not isinstance(usage, dict):
        raise MalformedUpstreamError(f"usage is not an object: {usage!r}")
    details = usage.get("prompt_tokens_details")
    cached = None
    if isinstance(details, dict) and details.get("cached_tokens") is not None:
        cached = _count(details["cached_tokens"], "prompt_tokens_details.cached_tokens")
    return Usage(
        prompt_tokens=_count(usage.get("prompt_tokens"), "prompt_tokens"),
        completion_tokens=_count(usage.get("completion_tokens", 0), "completion_tokens"),
        cached_tokens=cached,
    )


def decode_json_object(text: str | bytes, what: str) -> dict[str, Any]:
    try:
        payload = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise MalformedUpstreamError(f"{what} is not JSON: {exc}") from exc
    if not isinstance(payload, dict):
        raise MalformedUpstreamError(f"{what} is not a JSON object")
    return payload


def chunk_from_event_data(data: str) -> StreamChunk:
    """One SSE `data:` payload as a chunk; `[DONE]` becomes the done chunk."""
    if data.strip() == DONE_MARKER:
        return StreamChunk(data=None, done=True)
    payload = decode_json_object(data, "SSE event")
    return StreamChunk(data=payload, usage=usage_from(payload), raw=data)


def chunk_from_body(raw: bytes) -> StreamChunk:
    """A whole non-streaming response as its single chunk."""
    try:
        text = raw.decode()
    except UnicodeDecodeError as exc:
        raise MalformedUpstreamError(f"response body is not UTF-8: {exc}") from exc
    payload = decode_json_object(text, "response body")
    return StreamChunk(data=payload, usage=usage_from(payload), raw=text)
