"""Which request fields reach the engine, and within which bounds (docs/security.md SEC-2,
SEC-6, SEC-17; the trust boundary).

Only the governor picks a request's namespace, limits and engine features. A body's fields
fall in four sets:

- the governor's own (`cache_salt`, `priority`): never forwarded as the client sent them
  (the salt policy rejects or strips a client salt; the governor sets priority);
- sampling fields, always allowed, each within `RequestLimits`;
- feature groups that steer the engine's internals (KV transfer, prompt embeddings, chat
  templates, multimodal inputs, structured outputs, tools, raw engine extras, client request
  ids, ...): refused with a 400 naming the field unless the operator enables the group for
  the tenant (`[[tenants]] allow = [...]`); media URLs, even then, only against the tenant's
  `media_url_allowlist` (or inline `data:` URLs);
- anything else is unknown: refused, or dropped when the operator chose
  `[server] unknown_fields = "drop"`.

`max_tokens` is always set on the forwarded request: `min(requested or cap, cap)` with the
tenant's cap (or the server's default cap), so leaving the field out never lifts a limit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from schemas.openai import AnyRequest, ChatRequest, CompletionRequest, Message
from schemas.values import is_int

UnknownFields = Literal["reject", "drop"]
INT64_MAX = (1 << 63) - 1

GOVERNOR_FIELDS = frozenset({"cache_salt", "priority"})
COMMON_FIELDS = frozenset({
    "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
    "stop_token_ids", "frequency_penalty", "presence_penalty", "repetition_penalty",
    "logit_bias", "bad_words", "allowed_token_ids", "min_tokens", "ignore_eos",
    "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens", "n",
    "user", "stream", "stream_options", "logprobs", "add_special_tokens", "echo",
})
ROUTE_FIELDS = MappingProxyType({
    "chat": COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs",
                             "add_generation_prompt", "continue_final_message"},
    "completions": COMMON_FIELDS | {"prompt", "best_of", "suffix"},
})
FEATURE_GROUPS: Mapping[str, frozenset[str]] = MappingProxyType({
    "structured_outputs": frozenset({"structured_outputs", "response_format", "guided_json",
                                     "guided_regex", "guided_choice", "guided_grammar",
                                     "guided_decoding_backend", "guided_whitespace_pattern"}),
    "tools": frozenset({"tools", "tool_choice", "parallel_tool_calls", "functions",
                        "function_call"}),
    "chat_template": frozenset({"chat_template", "chat_template_kwargs", "documents"}),
    "multimodal": frozenset({"mm_processor_kwargs", "media_io_kwargs", "mm_payload",
                             "return_mm_kwargs"}),
    "kv_transfer": frozenset({"kv_transfer_params", "ec_transfer_params"}),
    "prompt_embeds": frozenset({"prompt_embeds"}),
    "vllm_xargs": frozenset({"vllm_xargs"}),
    "request_id": frozenset({"request_id", "session_id"}),
    "prompt_logprobs": frozenset({"prompt_logprobs", "logprob_token_ids"}),
    "token_ids_outputs": frozenset({"return_tokens_as_token_ids", "return_token_ids",
                                    "return_token_offsets", "return_prompt_text",
                                    "routed_experts_prompt_start"}),
    "beam_search": frozenset({"use_beam_search", "length_penalty"}),
    "truncation": frozenset({"truncate_prompt_tokens", "truncation_side"}),
    "reasoning": frozenset({"reasoning_effort", "thinking_token_budget",
                            "include_reasoning"}),
    "engine_extras": frozenset({"repetition_detection", "stream_interval", "watermarking"}),
})
GROUP_OF = MappingProxyType({name: group for group, names in FEATURE_GROUPS.items()
                             for name in names})
# What a route forwards (or the governor replaces) without a decision: one set difference
# clears a plain body.
_PLAIN = MappingProxyType({route: known | GOVERNOR_FIELDS for route, known in ROUTE_FIELDS.items()})
TEXT_PART = "text"
# Content part type → the key of its URL (None: the part carries its data inline).
MEDIA_PART_KEYS = MappingProxyType({"image_url": "url", "video_url": "url", "audio_url": "url",
                                    "input_audio": None, "file": None, "image_embeds": None})


class FieldRefused(ValueError):
    """A field the governor will not forward; `param` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Bounds on what one body may ask of the engine (counts and sizes)."""

    max_stop: int = 16
    max_stop_chars: int = 256
    max_stop_token_ids: int = 64
    max_logit_bias: int = 300
    max_bad_words: int = 64
    max_bad_word_chars: int = 256
    max_allowed_token_ids: int = 4096
    max_logprobs: int = 20
    max_user_chars: int = 256

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True, slots=True)
class FieldRules:
    """Everything the decision depends on, for one tenant and engine."""

    allow: frozenset[str] = frozenset()
    unknown_fields: UnknownFields = "reject"
    media_url_allowlist: tuple[str, ...] = ()
    limits: RequestLimits = field(default_factory=RequestLimits)

    def __post_init__(self) -> None:
        unknown = self.allow - FEATURE_GROUPS.keys()
        if unknown:
            raise ValueError(f"unknown feature group(s) {sorted(unknown)}; known: "
                             f"{sorted(FEATURE_GROUPS)}")
        if self.unknown_fields not in ("reject", "drop"):
            raise ValueError("unknown_fields must be 'reject' or 'drop'")


def effective_max_tokens(requested: int | None, cap: int) -> int:
    """`min(requested or cap, cap)`: the value always forwarded."""
    return min(requested or cap, cap)


def fields_to_drop(route: str, body: AnyRequest, rules: FieldRules) -> tuple[str, ...]:
    """Check every top-level field the client set; return the unknown ones to drop (in
    `drop` mode). Raises FieldRefused for a field the tenant may not use."""
    others = body.model_fields_set.union(body.extra_fields).difference(_PLAIN[route])
    drop = []
    for name in sorted(others):
        group = GROUP_OF.get(name)
        if group is not None:
            if group not in rules.allow and not _harmless(name, body):
                raise FieldRefused(f"'{name}' steers the engine and is not enabled for this "
                                   f"tenant (operator feature group '{group}')", name)
        elif rules.unknown_fields == "reject":
            raise FieldRefused(f"unknown field '{name}'", name)
        else:
            drop.append(name)
    return tuple(drop)


def _harmless(name: str, body: AnyRequest) -> bool:
    """`response_format: {"type": "text"}` is the default output, not a structured one."""
    value = body.extra_fields.get(name)
    return name == "response_format" and isinstance(value, Mapping) and \
        value.get("type") == "text" and len(value) == 1


def check_bounds(body: AnyRequest, rules: FieldRules, max_tokens: int) -> None:
    """Counts, sizes and ranges of the sampling fields; `max_tokens` is the effective one.

    Only the fields the client set are looked at: an unset field holds its default, which
    every bound admits (tests/governor/test_trust_boundary.py proves it). Where several are
    out of bounds, the one refused is the first in `_BOUNDS` order, whatever the body's."""
    checks = _BOUNDS[type(body)]
    names: Any = checks.keys() & body.model_fields_set
    if len(names) > 1:
        names = sorted(names, key=_ORDER[type(body)].__getitem__)
    for name in names:
        value = getattr(body, name)
        if value is not None:
            checks[name](value, body, rules.limits, max_tokens)


Check = Callable[[Any, AnyRequest, RequestLimits, int], None]


def _stream_options(value: Any, body: AnyRequest, lim: RequestLimits, max_tokens: int) -> None:
    if not body.stream:
        raise FieldRefused("Stream options can only be defined when `stream=True`.",
                           "stream_options")


def _stop(value: Any, body: AnyRequest, lim: RequestLimits, max_tokens: int) -> None:
    stops = [value] if isinstance(value, str) else value
    _count(stops, "stop", lim.max_stop)
    if any(not s or len(s) > lim.max_stop_chars for s in stops):
        raise FieldRefused(f"each 'stop' string must have 1 to {lim.max_stop_chars} "
                           "characters", "stop")


def _logit_bias(value: Any, body: AnyRequest, lim: RequestLimits, max_tokens: int) -> None:
    _count(value, "logit_bias", lim.max_logit_bias)
    for token, bias in value.items():
        if not token.isdigit() or not -100.0 <= bias <= 100.0:
            raise FieldRefused("'logit_bias' maps token ids to a bias in [-100, 100]",
                               "logit_bias")


def _bad_words(value: Any, body: AnyRequest, lim: RequestLimits, max_tokens: int) -> None:
    _count(value, "bad_words", lim.max_bad_words)
    if any(len(w) > lim.max_bad_word_chars for w in value):
        raise FieldRefused(f"each 'bad_words' entry is at most {lim.max_bad_word_chars} "
                           "characters", "bad_words")


def _user(value: Any, body: AnyRequest, lim: RequestLimits, max_tokens: int) -> None:
    if len(value) > lim.max_user_chars:
        raise FieldRefused(f"'user' is at most {lim.max_user_chars} characters", "user")


def _floats(name: str, lo: float, hi: float, low_open: bool = False) -> Check:
    return lambda value, *_: _range(value, name, lo, hi, low_open)


def _ints(name: str, lo: int, hi: int) -> Check:
    return lambda value, *_: _int_range(value, name, lo, hi)


_HEAD: Mapping[str, Check] = MappingProxyType({
    "stream_options": _stream_options,
    "temperature": _floats("temperature", 0.0, 2.0),
    "top_p": _floats("top_p", 0.0, 1.0, low_open=True),
    "min_p": _floats("min_p", 0.0, 1.0),
    "frequency_penalty": _floats("frequency_penalty", -2.0, 2.0),
    "presence_penalty": _floats("presence_penalty", -2.0, 2.0),
    "repetition_penalty": _floats("repetition_penalty", 0.0, 2.0, low_open=True),
    "top_k": _ints("top_k", -1, INT64_MAX),
    "seed": _ints("seed", -INT64_MAX - 1, INT64_MAX),
    "max_tokens": _ints("max_tokens", 1, INT64_MAX),
})
_TAIL: Mapping[str, Check] = MappingProxyType({
    "min_tokens": lambda value, body, lim, max_tokens: _int_range(value, "min_tokens", 0,
                                                                  max_tokens),
    "stop": _stop,
    "stop_token_ids": lambda value, body, lim, _: _count(value, "stop_token_ids",
                                                         lim.max_stop_token_ids),
    "logit_bias": _logit_bias,
    "bad_words": _bad_words,
    "allowed_token_ids": lambda value, body, lim, _: _count(value, "allowed_token_ids",
                                                            lim.max_allowed_token_ids),
    "user": _user,
    # One choice per request: per-choice accounting and cache probes assume it.
    "n": _ints("n", 1, 1),
})
# Per body type (a field of the other route's is unknown here, judged by fields_to_drop).
_BOUNDS: Mapping[type, Mapping[str, Check]] = MappingProxyType({
    ChatRequest: MappingProxyType({
        **_HEAD, "max_completion_tokens": _ints("max_completion_tokens", 1, INT64_MAX),
        **_TAIL, "top_logprobs": lambda value, body, lim, _: _int_range(
            value, "top_logprobs", 0, lim.max_logprobs)}),
    CompletionRequest: MappingProxyType({
        **_HEAD, **_TAIL, "best_of": _ints("best_of", 1, 1),
        "logprobs": lambda value, body, lim, _: _int_range(value, "logprobs", 0,
                                                           lim.max_logprobs)}),
})
_ORDER = MappingProxyType({kind: MappingProxyType({name: i for i, name in enumerate(checks)})
                           for kind, checks in _BOUNDS.items()})


def check_messages(body: ChatRequest, rules: FieldRules) -> None:
    """Text parts always; other content parts only with the `multimodal` group, and their
    URLs only inline (`data:`) or under the tenant's media URL allowlist."""
    if not body.messages:
        raise FieldRefused("'messages' must be a non-empty list", "messages")
    for i, message in enumerate(body.messages):
        for j, part in enumerate(_parts(message)):
            kind = part.get("type")
            if kind == TEXT_PART:
                if not isinstance(part.get("text"), str):
                    raise FieldRefused("a text part needs a 'text' string",
                                       f"messages.{i}.content.{j}.text")
                continue
            param = f"messages.{i}.content.{j}"
            if "multimodal" not in rules.allow:
                raise FieldRefused(f"content part type {kind!r} is not enabled for this "
                                   "tenant (operator feature group 'multimodal'); send "
                                   "text parts", f"{param}.type")
            _check_media_url(part, kind, rules, param)


def _parts(message: Message) -> list[dict[str, Any]]:
    return message.content if isinstance(message.content, list) else []


def _check_media_url(part: Mapping[str, Any], kind: Any, rules: FieldRules,
                     param: str) -> None:
    if kind not in MEDIA_PART_KEYS:
        raise FieldRefused(f"unknown content part type {kind!r}", f"{param}.type")
    key = MEDIA_PART_KEYS[kind]
    if key is None:
        return
    holder = part.get(kind)
    url = holder.get(key) if isinstance(holder, Mapping) else holder
    if not isinstance(url, str):
        raise FieldRefused(f"a {kind} part needs a URL", f"{param}.{kind}")
    if url.startswith("data:") or any(url.startswith(p) for p in rules.media_url_allowlist):
        return
    raise FieldRefused(f"{kind} URL is not on this tenant's media URL allowlist",
                       f"{param}.{kind}")


def _range(value: float | None, name: str, lo: float, hi: float,
           low_open: bool = False) -> None:
    if value is None:
        return
    if not math.isfinite(value) or value > hi or value < lo or (low_open and value == lo):
        bracket = "(" if low_open else "["
        raise FieldRefused(f"'{name}' must be a number in {bracket}{lo:g}, {hi:g}]", name)


def _int_range(value: int | None, name: str, lo: int, hi: int) -> None:
    if value is not None and not lo <= value <= hi:
        raise FieldRefused(f"'{name}' must be an integer in [{lo}, {hi}], got {value}", name)


def _count(values: Any, name: str, most: int) -> None:
    if values is not None and len(values) > most:
        raise FieldRefused(f"'{name}' has {len(values)} entries; at most {most} are allowed",
                           name)
