"""OpenAI requests and responses as vLLM 0.32 speaks them, for the native engine.

Shared by the in-process driver and `fak engine serve`, so both answer like a vLLM server
(vectors/vllm-0.32.0-cpu/http.jsonl): same keys, value types and error `type`/`param`.

Bodies are typed by the one validation layer (schemas.openai); this module renders its
failures as vLLM does — 400, type "Bad Request", param `body.<field>`, a "1 validation
error:" message with pydantic's error type and text — after vLLM's salt rule, which answers
type "BadRequestError", param `cache_salt`. Then come the native engine's own refusals:
features it does not implement are refused loudly, never ignored.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from native_engine.request import MAX_LOGPROBS, SamplingParams
from policies.salts import validate_vllm_cache_salt
from schemas.engine import EngineError
from schemas.openai import (
    AnyRequest,
    ChatRequest,
    RequestInvalid,
    Route,
    load_json,
    parse_request,
)

SYSTEM_FINGERPRINT = "fak-native"
# Features a vLLM server offers that this engine does not: refused loudly, never ignored.
UNSUPPORTED_IF_SET: dict[str, Any] = {
    "n": 1, "best_of": None, "echo": False, "use_beam_search": False, "prompt_logprobs": None,
    "tools": None, "response_format": None, "logit_bias": None,
}


def bad_request(message: str, param: str | None, type_: str = "BadRequestError") -> EngineError:
    return EngineError(400, message, type=type_, param=param)


def _summary(value: Any) -> Any:
    """How vLLM's error text shows a rejected input: containers by size, scalars as is."""
    if isinstance(value, dict):
        return f"<dict of {len(value)} items>"
    if isinstance(value, list):
        return f"<list of {len(value)} items>"
    return value


def validation_error(errors: tuple[dict[str, Any], ...]) -> EngineError:
    """vLLM's answer to a request-validation failure (FastAPI's errors, `body.` located)."""
    shown = []
    for err in errors:
        item = {"type": err["type"], "loc": ".".join(str(p) for p in ("body", *err["loc"])),
                "msg": err["msg"], "input": _summary(err.get("input"))}
        if err.get("ctx"):
            item["ctx"] = {k: str(v) for k, v in err["ctx"].items()}
        shown.append(item)
    plural = "" if len(shown) == 1 else "s"
    message = f"{len(shown)} validation error{plural}:\n" + "\n".join(f"  {e}" for e in shown)
    return bad_request(message, shown[0]["loc"], "Bad Request")


def parse_json(raw: bytes) -> Any:
    """The request's JSON, or vLLM's 400 for a body that is not JSON (param `body.<pos>`)."""
    try:
        return load_json(raw)
    except RequestInvalid as exc:
        raise validation_error(exc.errors) from None


def check_cache_salt(body: dict[str, Any]) -> str | None:
    """vLLM's salt rule with vLLM's message; the salt is the request's cache namespace."""
    if "cache_salt" not in body:
        return None
    message = validate_vllm_cache_salt(body["cache_salt"])
    if message is not None:
        raise bad_request(message, "cache_salt")
    return body["cache_salt"]


def validate_body(route: Route, body: Any) -> AnyRequest:
    """Salt rule, then field types, then what this engine refuses (in vLLM's order)."""
    if isinstance(body, dict):
        check_cache_salt(body)
    try:
        parsed = parse_request(route, body)
    except RequestInvalid as exc:
        raise validation_error(exc.errors) from None
    check_supported(parsed)
    return parsed


def check_supported(parsed: AnyRequest) -> None:
    """Features this engine does not implement are refused, never ignored."""
    for name, default in UNSUPPORTED_IF_SET.items():
        value = getattr(parsed, name, None) if name in type(parsed).model_fields \
            else parsed.extra_fields.get(name, default)
        if value is not None and value != default and name in parsed.set_fields:
            raise bad_request(f"'{name}' is not supported by the native engine", name)
    if parsed.stream_options is not None and not parsed.stream:
        raise bad_request("Stream options can only be defined when `stream=True`.",
                          "stream_options")
    if isinstance(parsed, ChatRequest):
        for i, message in enumerate(parsed.messages):
            if message.text() is None:
                raise bad_request("the native engine takes text content only (text parts "
                                  "or a string)", f"messages.{i}.content")


def check_model(parsed: AnyRequest, served: str) -> None:
    if parsed.model is not None and parsed.model != served:
        raise EngineError(404, f"The model `{parsed.model}` does not exist. Valid aliases: "
                          f"{served}.", type="NotFoundError", param="model")


def _logprobs(parsed: AnyRequest) -> int | None:
    if isinstance(parsed, ChatRequest):
        return (parsed.top_logprobs or 0) if parsed.logprobs else None
    return parsed.logprobs


def sampling_params(parsed: AnyRequest, prompt_len: int, max_model_len: int,
                    stop_token_ids: tuple[int, ...], priority_enabled: bool,
                    namespace: str | None = None, priority: int | None = None
                    ) -> SamplingParams:
    """SamplingParams of a validated body, answering vLLM's 400s for bad values.
    `max_tokens` is clamped to the room the prompt leaves, as vLLM 0.32 does (its
    `get_max_tokens`). `namespace` / `priority` given (the in-process path) take the place
    of the body's; priority is dropped (not refused) when priority scheduling is off, as
    vLLM V1 ignores it under FCFS."""
    room = max_model_len - prompt_len
    if room < 1:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {prompt_len} input tokens. Please reduce the length of the input.",
            "input_tokens")
    requested = parsed.requested_max_tokens
    if requested is not None and requested < 1:
        raise bad_request(f"'max_tokens' is {requested}; it must be at least 1", "max_tokens")
    default = room if isinstance(parsed, ChatRequest) else min(16, room)
    max_tokens = min(room, requested) if requested is not None else default
    logprobs = _logprobs(parsed)
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise bad_request(f"logprobs must be in [0, {MAX_LOGPROBS}]", "logprobs")
    stop = (parsed.stop,) if isinstance(parsed.stop, str) else tuple(parsed.stop or ())
    chosen = parsed.priority if priority is None else priority
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if parsed.temperature is None else parsed.temperature,
            top_p=1.0 if parsed.top_p is None else parsed.top_p,
            top_k=parsed.top_k or 0,
            seed=parsed.seed,
            stop=stop,
            # The model's end-of-generation ids stop a request unless ignore_eos (as vLLM,
            # which adds generation-config EOS ids to stop_token_ids only without it).
            stop_token_ids=tuple(parsed.stop_token_ids or ())
            + (() if parsed.ignore_eos else stop_token_ids),
            ignore_eos=parsed.ignore_eos,
            logprobs=logprobs,
            priority=chosen if priority_enabled else 0,
            namespace=parsed.cache_salt if namespace is None else namespace,
        )
    except ValueError as exc:  # a SamplingParamError names its field
        raise bad_request(str(exc), getattr(exc, "param", None)) from None


# -- responses ----------------------------------------------------------------------------


@dataclass(slots=True)
class Completion:
    """What the engine produced for one request, as the response builders need it."""

    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    stop_reason: str | int | None = None
    created_cache_tokens: int | None = None


def usage_dict(c: Completion, details: bool, stream: bool = False) -> dict[str, Any]:
    """vLLM's usage; in a stream's usage chunk the details omit `multimodal_tokens`."""
    usage: dict[str, Any] = {
        "prompt_tokens": c.prompt_tokens,
        "total_tokens": c.prompt_tokens + c.completion_tokens,
        "completion_tokens": c.completion_tokens,
        "prompt_tokens_details": None,
    }
    if details:
        usage["prompt_tokens_details"] = {"cached_tokens": c.cached_tokens,
                                          "created_cache_tokens": c.created_cache_tokens}
        if not stream:
            usage["prompt_tokens_details"]["multimodal_tokens"] = None
    if not stream:
        usage["completion_tokens_details"] = None
    return usage


def full_response(route: Route, request_id: str, model: str, c: Completion, details: bool,
                  created: int | None = None, logprobs: dict[str, Any] | None = None
                  ) -> dict[str, Any]:
    created = created if created is not None else int(time.time())
    end = {"finish_reason": c.finish_reason, "stop_reason": c.stop_reason, "token_ids": None}
    if route == "chat":
        message = {"role": "assistant", "content": c.text, "refusal": None,
                   "annotations": None, "audio": None, "function_call": None,
                   "reasoning": None}
        choice = {"index": 0, "message": message, "logprobs": logprobs, **end,
                  "routed_experts": None}
        obj, prompt_extras = "chat.completion", {"prompt_logprobs": None,
                                                 "prompt_token_ids": None, "prompt_text": None}
    else:
        choice = {"index": 0, "text": c.text, "logprobs": logprobs, **end,
                  "prompt_logprobs": None, "prompt_token_ids": None, "routed_experts": None}
        obj, prompt_extras = "text_completion", {}
    return {"id": request_id, "object": obj, "created": created, "model": model,
            "choices": [choice], "service_tier": None, "system_fingerprint": SYSTEM_FINGERPRINT,
            "usage": usage_dict(c, details), **prompt_extras, "kv_transfer_params": None,
            "ec_transfer_params": None, "metrics": None}


def role_chunk(request_id: str, model: str, created: int) -> dict[str, Any]:
    """A chat stream's first chunk: the role, before any token (as vLLM sends it)."""
    choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
              "finish_reason": None}
    return {"id": request_id, "object": "chat.completion.chunk", "created": created,
            "model": model, "choices": [choice], "prompt_token_ids": None, "prompt_text": None}


def stream_chunk(route: Route, request_id: str, model: str, created: int, delta: str,
                 finish_reason: str | None, logprobs: dict[str, Any] | None = None,
                 stop_reason: str | int | None = None) -> dict[str, Any]:
    if route == "chat":
        choice: dict[str, Any] = {"index": 0, "delta": {"content": delta}}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": delta}
        obj = "text_completion"
    choice.update(logprobs=logprobs, finish_reason=finish_reason)
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    choice["token_ids"] = None
    return {"id": request_id, "object": obj, "created": created, "model": model,
            "choices": [choice]}


def usage_chunk(route: Route, request_id: str, model: str, created: int, c: Completion,
                details: bool) -> dict[str, Any]:
    return {"id": request_id,
            "object": "chat.completion.chunk" if route == "chat" else "text_completion",
            "created": created, "model": model, "choices": [],
            "usage": usage_dict(c, details, stream=True), "system_fingerprint": SYSTEM_FINGERPRINT}


def chat_logprobs(entries: list[tuple[str, float, list[tuple[str, float]]]]) -> dict[str, Any]:
    """`choices[].logprobs` of a chat answer: per token its text, logprob, UTF-8 bytes and
    the top alternatives."""
    def item(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {"content": [{**item(t, lp), "top_logprobs": [item(a, alp) for a, alp in top]}
                        for t, lp, top in entries]}


def completion_logprobs(entries: list[tuple[str, float, list[tuple[str, float]]]],
                        start_offset: int = 0) -> dict[str, Any]:
    """`choices[].logprobs` of a completion: parallel lists, offsets into the output text."""
    offsets, offset = [], start_offset
    for token, _, _ in entries:
        offsets.append(offset)
        offset += len(token)
    return {"text_offset": offsets, "token_logprobs": [lp for _, lp, _ in entries],
            "tokens": [t for t, _, _ in entries],
            "top_logprobs": [dict(top) for _, _, top in entries]}


def response_id(route: Route, request_id: str) -> str:
    return ("chatcmpl-" if route == "chat" else "cmpl-") + request_id
