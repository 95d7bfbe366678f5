"""OpenAI request/response shapes as vLLM 0.32 speaks them, for the native engine.

Shared by the in-process driver and `fak engine serve`, so both answer like a vLLM server
(vectors/vllm-0.32.0-cpu/http.jsonl): same keys, value types and error `type`/`param`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from native_engine.request import MAX_LOGPROBS, SamplingParams
from policies.salts import validate_vllm_cache_salt
from schemas.engine import EngineError

SYSTEM_FINGERPRINT = "fak-native"


def bad_request(message: str, param: str | None, type_: str = "BadRequestError") -> EngineError:
    return EngineError(400, message, type=type_, param=param)


def _int_field(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(
            f"1 validation error:\n  {{'type': 'int_parsing', 'loc': 'body.{name}', "
            f"'msg': 'Input should be a valid integer', 'input': {value!r}}}",
            f"body.{name}", "Bad Request")
    return value


def check_cache_salt(body: dict[str, Any]) -> str | None:
    """vLLM's salt rule with vLLM's message; the salt is the request's cache namespace."""
    if "cache_salt" not in body:
        return None
    message = validate_vllm_cache_salt(body["cache_salt"])
    if message is not None:
        raise bad_request(f"{message} (parameter=cache_salt)", "cache_salt")
    return body["cache_salt"]


def _stops(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) and s for s in stop):
        return tuple(stop)
    raise bad_request("'stop' must be a string or a list of non-empty strings", "stop")


def _logprobs(route: str, body: dict[str, Any]) -> int | None:
    if route == "chat":
        if not body.get("logprobs"):
            return None
        return _int_field(body, "top_logprobs") or 0
    return _int_field(body, "logprobs")


def sampling_params(route: str, body: dict[str, Any], prompt_len: int, max_model_len: int,
                    stop_token_ids: tuple[int, ...], priority_enabled: bool) -> SamplingParams:
    """Map an OpenAI body to SamplingParams, answering vLLM's 400s for bad values."""
    room = max_model_len - prompt_len
    if room < 1:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {prompt_len} input tokens. Please reduce the length of the input.",
            "input_tokens")
    max_tokens = _int_field(body, "max_completion_tokens") or _int_field(body, "max_tokens")
    if max_tokens is None:
        max_tokens = room if route == "chat" else min(16, room)
    if max_tokens < 1 or max_tokens > room:
        raise bad_request(f"'max_tokens' is {max_tokens}; it must be in [1, {room}] for this "
                          "prompt", "max_tokens")
    priority = _int_field(body, "priority") or 0
    logprobs = _logprobs(route, body)
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise bad_request(f"logprobs must be in [0, {MAX_LOGPROBS}]", "logprobs")
    extra_stop_ids = body.get("stop_token_ids") or []
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=float(body.get("temperature", 1.0)),
            top_p=float(body.get("top_p", 1.0)),
            top_k=_int_field(body, "top_k") or 0,
            seed=_int_field(body, "seed"),
            stop=_stops(body),
            stop_token_ids=tuple(extra_stop_ids) + stop_token_ids,
            ignore_eos=bool(body.get("ignore_eos", False)),
            logprobs=logprobs,
            priority=priority if priority_enabled else 0,
            namespace=check_cache_salt(body),
        )
    except (TypeError, ValueError) as exc:
        raise bad_request(str(exc), None) from None


@dataclass(slots=True)
class Completion:
    """What the engine produced for one request, as the response builders need it."""

    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


def usage_dict(c: Completion, details: bool) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": c.prompt_tokens,
        "total_tokens": c.prompt_tokens + c.completion_tokens,
        "completion_tokens": c.completion_tokens,
        "prompt_tokens_details": None,
    }
    if details:
        usage["prompt_tokens_details"] = {
            "cached_tokens": c.cached_tokens,
            "created_cache_tokens": None,
            "multimodal_tokens": None,
        }
    return usage


def _finish(c: Completion) -> dict[str, Any]:
    return {"finish_reason": c.finish_reason, "stop_reason": None}


def full_response(route: str, request_id: str, model: str, c: Completion,
                  details: bool, created: int | None = None) -> dict[str, Any]:
    created = created if created is not None else int(time.time())
    if route == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": c.text,
                                          "refusal": None},
                  "logprobs": None, **_finish(c)}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": c.text, "logprobs": None, **_finish(c)}
        obj = "text_completion"
    return {"id": request_id, "object": obj, "created": created, "model": model,
            "choices": [choice], "system_fingerprint": SYSTEM_FINGERPRINT,
            "usage": usage_dict(c, details)}


def stream_chunk(route: str, request_id: str, model: str, created: int, delta: str,
                 finish_reason: str | None, first: bool = False) -> dict[str, Any]:
    if route == "chat":
        body: dict[str, Any] = {"role": "assistant", "content": delta} if first else {
            "content": delta}
        choice = {"index": 0, "delta": body, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    if finish_reason is not None:
        choice["stop_reason"] = None
    return {"id": request_id, "object": obj, "created": created, "model": model,
            "choices": [choice]}


def usage_chunk(route: str, request_id: str, model: str, created: int, c: Completion,
                details: bool) -> dict[str, Any]:
    return {"id": request_id,
            "object": "chat.completion.chunk" if route == "chat" else "text_completion",
            "created": created, "model": model, "choices": [],
            "usage": usage_dict(c, details), "system_fingerprint": SYSTEM_FINGERPRINT}


def response_id(route: str, request_id: str) -> str:
    return ("chatcmpl-" if route == "chat" else "cmpl-") + request_id
