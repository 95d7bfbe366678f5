"""OpenAI request bodies as vLLM 0.32 declares them: the one validation layer.

The governor and `fak engine serve` both parse client bodies here, so a body means the same
thing on every path. `load_json` turns raw bytes into JSON values and refuses what no field
can hold (invalid UTF-8, NaN/Infinity, lone surrogates, nesting deeper than
`MAX_JSON_DEPTH`). `parse_request` types the fields any engine acts on with vLLM's
declared types (pydantic, lax like vLLM's FastAPI models); every other field stays in
`model_extra`, untyped, for the field policy (policies.request_fields) to allow, drop or
refuse. Failures raise `RequestInvalid` with the offending parameter and pydantic's error
list, so each front renders them in its own vocabulary (the governor as an OpenAI
`invalid_request_error`, the native server as vLLM's `Bad Request`).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

MAX_JSON_DEPTH = 64
# A chat's messages are validated and dumped this many at a time. One pydantic call holds
# the GIL throughout: over 115,000 messages (a 4 MiB body) it held it 300-500 ms, a stall of
# every other request even from a worker thread; a chunk holds it ~3 ms.
MESSAGE_CHUNK = 1024
Route = Literal["chat", "completions"]
ROLES = ("system", "user", "assistant", "tool", "developer")


class RequestInvalid(ValueError):
    """A body that cannot be taken. `param` names the field (dotted path, None for the body
    as a whole); `errors` are pydantic-shaped dicts (type, loc, msg, input, ctx)."""

    def __init__(self, message: str, param: str | None,
                 errors: tuple[dict[str, Any], ...] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.errors = errors


# -- raw JSON -------------------------------------------------------------------------------


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


_DECODER = json.JSONDecoder(parse_constant=_no_constants)  # built once, not per body


def load_json(raw: bytes) -> Any:
    """The body's JSON value; RequestInvalid for anything a request field cannot carry."""
    if not raw.strip():
        raise RequestInvalid("the request body is empty", None,
                             ({"type": "missing", "loc": (), "msg": "Field required",
                               "input": None},))
    try:
        text = raw.decode("utf-8")
        value = _DECODER.decode(text)
    except UnicodeDecodeError as exc:
        raise RequestInvalid(f"the request body is not UTF-8: {exc.reason} at byte "
                             f"{exc.start}", None, _json_error(exc.start, exc.reason)) from None
    except json.JSONDecodeError as exc:
        raise RequestInvalid(f"the request body is not valid JSON: {exc.msg} at "
                             f"position {exc.pos}", None, _json_error(exc.pos, exc.msg)) from None
    except ValueError as exc:  # NaN / Infinity
        raise RequestInvalid(f"the request body is not valid JSON: {exc}", None,
                             _json_error(0, str(exc))) from None
    except RecursionError:
        raise RequestInvalid(f"the request body nests deeper than {MAX_JSON_DEPTH} levels",
                             None, _json_error(0, "nesting too deep")) from None
    # Strict UTF-8 cannot carry a surrogate: only a \\uD800-\\uDFFF escape can make one.
    check_json_values(value, strings=b"\\ud" in raw.lower())
    return value


def _json_error(pos: int, reason: str) -> tuple[dict[str, Any], ...]:
    return ({"type": "json_invalid", "loc": (pos,), "msg": "JSON decode error", "input": {},
             "ctx": {"error": reason}},)


_CONTAINERS = (dict, list)  # a tuple: `dict | list` builds a union object at each test


def check_json_values(value: Any, strings: bool = True) -> None:
    """Depth ≤ MAX_JSON_DEPTH and (with `strings`) no lone surrogate in any string or key
    (they cannot be encoded to UTF-8 again, so no engine could receive them). One pass,
    iterative; only containers are pushed."""
    if not isinstance(value, _CONTAINERS):
        if strings and isinstance(value, str):
            _check_text(value)
        return
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise RequestInvalid(f"the request body nests deeper than {MAX_JSON_DEPTH} "
                                 "levels", None, _json_error(0, "nesting too deep"))
        children = item.values() if isinstance(item, dict) else item
        if strings and isinstance(item, dict):
            for key in item:
                _check_text(key)
        for child in children:
            if isinstance(child, _CONTAINERS):
                stack.append((child, depth + 1))
            elif strings and isinstance(child, str):
                _check_text(child)


def _check_text(text: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestInvalid("the request body holds a lone UTF-16 surrogate (\\ud800-"
                             "\\udfff without its pair)", None,
                             _json_error(0, "lone surrogate")) from None


# -- typed bodies ---------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = True  # vLLM's default once stream_options is given
    continuous_usage_stats: bool | None = False


class _Body(BaseModel):
    """Fields every route shares, typed as vLLM declares them."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    n: int | None = None
    user: str | None = None
    priority: int = 0
    cache_salt: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None

    def wire(self) -> dict[str, Any]:
        """The fields the client set (and the extras), as JSON values: what is forwarded."""
        return self.model_dump(mode="json", exclude_unset=True)

    @property
    def extra_fields(self) -> dict[str, Any]:
        return self.model_extra or {}

    @property
    def set_fields(self) -> frozenset[str]:
        """Every top-level field the client sent, typed or not."""
        return frozenset(self.model_fields_set) | frozenset(self.extra_fields)


class CompletionRequest(_Body):
    prompt: list[int] | list[list[int]] | str | list[str] | None = None
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class Message(BaseModel):
    """One chat message. `content` is text, a list of content parts (each an object with a
    `type`; text parts carry `text`), or null (an assistant turn with tool calls)."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def text(self) -> str | None:
        """The content as text when it is text only (parts joined by newlines, as vLLM
        does); None when a part is not text."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = [p.get("text") for p in self.content]
        if any(p.get("type") != "text" or not isinstance(t, str)
               for p, t in zip(self.content, texts, strict=True)):
            return None
        return "\n".join(t for t in texts if isinstance(t, str))


class ChatRequest(_Body):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def wire(self) -> dict[str, Any]:
        """As `_Body.wire`; a long chat's messages are dumped `MESSAGE_CHUNK` at a time."""
        if len(self.messages) <= MESSAGE_CHUNK:
            return super().wire()
        rest = self.model_dump(mode="json", exclude_unset=True, exclude={"messages"})
        messages: list[dict[str, Any]] = []
        for start in range(0, len(self.messages), MESSAGE_CHUNK):
            messages.extend(_MESSAGES.dump_python(self.messages[start:start + MESSAGE_CHUNK],
                                                  mode="json", exclude_unset=True))
        head = {k: v for k, v in rest.items() if k in _BEFORE_MESSAGES}
        return {**head, "messages": messages,
                **{k: v for k, v in rest.items() if k not in _BEFORE_MESSAGES}}


AnyRequest = ChatRequest | CompletionRequest
_MESSAGES = TypeAdapter(list[Message])
_CHAT_FIELDS = tuple(ChatRequest.model_fields)
_BEFORE_MESSAGES = frozenset(_CHAT_FIELDS[:_CHAT_FIELDS.index("messages")])


def _param(loc: tuple[Any, ...]) -> str | None:
    return ".".join(str(p) for p in loc) or None


def parse_request(route: Route, value: Any) -> AnyRequest:
    """The typed body of one request; RequestInvalid names the first bad field."""
    if not isinstance(value, dict):
        raise RequestInvalid("the request body must be a JSON object", None,
                             ({"type": "model_attributes_type", "loc": (),
                               "msg": "Input should be a valid dictionary or object to "
                                      "extract fields from", "input": value},))
    if route == "chat":
        messages = value.get("messages")
        if isinstance(messages, list) and len(messages) > MESSAGE_CHUNK:
            return _parse_long_chat(value, messages)
    model: type[ChatRequest] | type[CompletionRequest] = \
        ChatRequest if route == "chat" else CompletionRequest
    try:
        parsed = model.model_validate(value)
    except ValidationError as exc:
        raise _invalid(exc.errors(include_url=False)) from None
    return parsed


def _parse_long_chat(value: dict[str, Any], messages: list[Any]) -> ChatRequest:
    """`ChatRequest.model_validate(value)` in steps (the body without its messages, then the
    messages a chunk at a time, so another thread gets the GIL between them): the same
    model, and the same errors in pydantic's order (by field, in declaration order)."""
    errors: list[Any] = []
    parsed = None
    try:
        parsed = ChatRequest.model_validate({**value, "messages": []})
    except ValidationError as exc:
        errors.extend(exc.errors(include_url=False))
    checked: list[Message] = []
    for start in range(0, len(messages), MESSAGE_CHUNK):
        try:
            checked.extend(_MESSAGES.validate_python(messages[start:start + MESSAGE_CHUNK]))
        except ValidationError as exc:
            errors.extend({**e, "loc": ("messages", start + int(e["loc"][0]), *e["loc"][1:])}
                          for e in exc.errors(include_url=False))
    if errors or parsed is None:
        errors.sort(key=lambda e: _CHAT_FIELDS.index(e["loc"][0])
                    if e["loc"] and e["loc"][0] in _CHAT_FIELDS else len(_CHAT_FIELDS))
        raise _invalid(errors)
    parsed.messages = checked
    return parsed


def _invalid(errors: Any) -> RequestInvalid:
    """RequestInvalid naming the first of pydantic's `errors`."""
    listed: tuple[dict[str, Any], ...] = tuple(dict(e) for e in errors)
    first = listed[0]
    param = _param(tuple(first["loc"]))
    return RequestInvalid(f"{param or 'body'}: {first['msg']}", param, listed)
