"""Validation of client request bodies: clear 400s that name the parameter."""

from __future__ import annotations

from typing import Any

from schemas.engine import EngineError

ROLES = {"system", "user", "assistant", "tool", "developer"}


def bad_request(message: str, param: str | None) -> EngineError:
    return EngineError(400, message, type="invalid_request_error", param=param)


def _number(body: dict[str, Any], name: str, lo: float, hi: float) -> None:
    value = body.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise bad_request(f"'{name}' must be a number in [{lo}, {hi}]", name)


def _messages(body: dict[str, Any]) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise bad_request(f"messages[{i}] needs a role in {sorted(ROLES)}",
                              f"messages.{i}.role")
        content = message.get("content")
        if not isinstance(content, str | list | None):
            raise bad_request(f"messages[{i}].content must be a string or a list",
                              f"messages.{i}.content")


def _prompt(body: dict[str, Any]) -> None:
    prompt = body.get("prompt")
    if isinstance(prompt, str) and prompt:
        return
    if isinstance(prompt, list) and prompt and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt
    ):
        return
    raise bad_request("'prompt' must be a non-empty string or a list of token ids", "prompt")


def max_tokens_of(body: dict[str, Any]) -> int | None:
    for name in ("max_completion_tokens", "max_tokens"):
        if body.get(name) is not None:
            return body[name]
    return None


def validate_body(route: str, body: Any, tenant_max_tokens: int) -> dict[str, Any]:
    """Check the fields the governor relies on; unknown fields pass through (as vLLM does)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None)
    if route == "chat":
        _messages(body)
    else:
        _prompt(body)
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise bad_request(f"'{name}' must be a positive integer", name)
        if value is not None and value > tenant_max_tokens:
            raise bad_request(f"'{name}' is {value}, above this tenant's limit of "
                              f"{tenant_max_tokens}", name)
    if not isinstance(body.get("stream", False), bool):
        raise bad_request("'stream' must be a boolean", "stream")
    if body.get("stream_options") is not None and not body.get("stream"):
        raise bad_request("Stream options can only be defined when `stream=True`.",
                          "stream_options")
    if body.get("n", 1) != 1:
        raise bad_request("only n = 1 is supported", "n")
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise bad_request("'model' must be a string", "model")
    _number(body, "temperature", 0.0, 2.0)
    _number(body, "top_p", 0.0, 1.0)
    return body
