"""One client body → one `EngineRequest`: the governor's checks, in order (docs/design.md §5).

1. client salts (SEC-2): rejected (400 `cache_salt`) or stripped and counted, by config —
   on the raw JSON, before typing, so a salt hidden in an engine-extras container is found;
2. typing by the one validation layer (schemas.openai);
3. the model: the engine's, or 404;
4. the field policy (policies.request_fields): steering fields only as the tenant may,
   unknown fields refused or dropped, content parts checked;
5. `max_tokens` always set (`min(requested or cap, cap)`), every bound checked;
6. what only the governor sets: model, max_tokens, usage on streams, salt, priority.

Everything here is synchronous and touches no I/O; it raises `GovernorError` (400/404).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from governor.errors import GovernorError, bad_request, not_found
from policies.request_fields import (
    FieldRefused,
    FieldRules,
    check_bounds,
    check_messages,
    effective_max_tokens,
    fields_to_drop,
)
from policies.salts import TooManyClientSalts, find_client_salts, strip_client_salts
from schemas.engine import EngineCapabilities, EngineRequest
from schemas.openai import (
    AnyRequest,
    ChatRequest,
    RequestInvalid,
    Route,
    StreamOptions,
    parse_request,
)


@dataclass(frozen=True, slots=True)
class PipelineInputs:
    """What the checks depend on, for one tenant (built once per tenant)."""

    rules: FieldRules
    max_tokens_cap: int
    client_salts: str  # "reject" | "strip"


@dataclass(frozen=True, slots=True)
class Prepared:
    """The forwarded request, whether the client asked for the usage chunk (the governor
    always asks upstream, to account), and how many client salts were stripped."""

    request: EngineRequest
    wants_usage: bool
    stripped_salts: int


class ClientSaltRejected(GovernorError):
    """The body carried a cache salt and the policy is reject (audited by the caller)."""


def prepare(route: Route, value: Any, inputs: PipelineInputs, caps: EngineCapabilities,
            tenant: str, request_id: str, salt: str | None,
            priority: int | None, body_bytes: int = 0) -> Prepared:
    value, stripped = _client_salts(value, inputs.client_salts)
    try:
        body = parse_request(route, value)
    except RequestInvalid as exc:
        raise bad_request(exc.message, exc.param) from None
    if body.model not in (None, caps.model_id):
        raise not_found(f"The model `{body.model}` does not exist.", "model")
    try:
        drop = fields_to_drop(route, body, inputs.rules)
        if isinstance(body, ChatRequest):
            check_messages(body, inputs.rules)
        max_tokens = effective_max_tokens(body.requested_max_tokens, inputs.max_tokens_cap)
        check_bounds(body, inputs.rules, max_tokens)
    except FieldRefused as exc:
        raise bad_request(exc.message, exc.param, reason="field_refused") from None
    wants_usage = bool(body.stream and body.stream_options is not None
                       and body.stream_options.include_usage)
    forwarded = _forwarded(body, caps.model_id, max_tokens, drop)
    request = EngineRequest(request_id, route, forwarded, tenant, salt, priority, body_bytes)
    return Prepared(request, wants_usage, stripped)


def _client_salts(value: Any, policy: str) -> tuple[Any, int]:
    if not isinstance(value, dict):
        return value, 0  # typing answers the 400
    if policy == "reject":
        try:
            found = bool(find_client_salts(value, max_hits=1))
        except TooManyClientSalts:
            found = True
        if found:
            raise ClientSaltRejected(400, "cache_salt is set by the governor; do not send "
                                     "one", "invalid_request_error", "cache_salt",
                                     reason="client_salt")
        return value, 0
    try:
        stripped, hits = strip_client_salts(value)
    except TooManyClientSalts as exc:
        raise bad_request(str(exc), "cache_salt", reason="client_salt") from None
    return stripped, len(hits)


def _forwarded(body: AnyRequest, model: str, max_tokens: int,
               drop: tuple[str, ...]) -> AnyRequest:
    """The client's body with what only the governor decides put in, in place (it was
    parsed for this request alone; a copy cost 2 µs a request) and not re-validated."""
    body.model = model
    body.max_tokens = max_tokens
    if isinstance(body, ChatRequest):
        body.max_completion_tokens = max_tokens
    if body.stream:
        options = body.stream_options or StreamOptions()
        options.include_usage = True
        body.stream_options = options
    body.model_fields_set.discard("priority")
    body.model_fields_set.discard("cache_salt")
    extra = body.__pydantic_extra__
    if extra is not None:
        for name in drop:
            extra.pop(name, None)
    return body
