"""SSE events and response bodies from vLLM as `StreamChunk`s (docs/reference/vllm-surfaces.md
§1.5-1.6).

The SSE framing itself is httpx-sse's (its line and event decoders, fed the bytes as they
arrive by `SSEFramer`); this module only turns each event's data into a chunk, unchanged: the
role-only first chunk, content chunks, the usage chunk (`choices: []`), an in-stream
`{"error": ...}` event and `[DONE]` are all relayed one to one.
"""

from __future__ import annotations

import codecs
import json
from typing import Any

import orjson
from httpx_sse import ServerSentEvent
from httpx_sse._decoders import SSEDecoder, SSELineDecoder

from schemas.engine import StreamChunk, Usage

DONE_MARKER = "[DONE]"


class MalformedUpstreamError(ValueError):
    """The engine sent something that is not the OpenAI shape it promised."""


class SSEFramer:
    """An event stream's bytes in, as they arrive; its complete events out.

    Text is decoded as UTF-8 with replacement across chunk boundaries and lines split on
    CR, LF or CRLF only, as httpx-sse does over an httpx response; an event is complete at
    its blank line, so one cut short by the end of the stream is never returned.
    """

    def __init__(self) -> None:
        self._text = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._lines = SSELineDecoder()
        self._events = SSEDecoder()

    def feed(self, data: bytes) -> list[ServerSentEvent]:
        text = self._text.decode(data)
        return self._dispatch(self._lines.decode(text)) if text else []

    def close(self) -> list[ServerSentEvent]:
        """The end of the stream: what the buffered tail completes."""
        tail = self._text.decode(b"", final=True)
        return self._dispatch((self._lines.decode(tail) if tail else []) + self._lines.flush())

    def _dispatch(self, lines: list[str]) -> list[ServerSentEvent]:
        events = []
        for line in lines:
            event = self._events.decode(line)
            if event is not None:
                events.append(event)
        return events


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
    """The JSON object in `text`, as the standard library reads it, at orjson's speed (~3.5×
    on an SSE event): what orjson refuses (NaN, Infinity, 1e400, lone surrogates) is read by
    `json`. One difference is kept: an integer past 64 bits is a float here, so a usage count
    that large is malformed (`usage_from` wants integers) where `json` would have summed it."""
    try:
        payload = orjson.loads(text)
    except orjson.JSONDecodeError:
        try:
            payload = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise MalformedUpstreamError(f"{what} is not JSON: {exc}") from exc
    if not isinstance(payload, dict):
        raise MalformedUpstreamError(f"{what} is not a JSON object")
    return payload


def chunk_from_event_data(data: str, more: bool = False) -> StreamChunk:
    """One SSE `data:` payload as a chunk (`more`: another is at hand after it); `[DONE]`
    becomes the done chunk."""
    if data.strip() == DONE_MARKER:
        return StreamChunk(data=None, done=True, more=more)
    payload = decode_json_object(data, "SSE event")
    # positional: a NamedTuple's keyword arguments cost ~2× (timeit), once per event
    return StreamChunk(payload, False, usage_from(payload), data, more)


def chunk_from_body(raw: bytes) -> StreamChunk:
    """A whole non-streaming response as its single chunk."""
    try:
        text = raw.decode()
    except UnicodeDecodeError as exc:
        raise MalformedUpstreamError(f"response body is not UTF-8: {exc}") from exc
    payload = decode_json_object(text, "response body")
    return StreamChunk(payload, False, usage_from(payload), text)
