"""The governor's own error vocabulary: what the governor decided, as OpenAI errors.

`schemas.engine.EngineError` is what an engine answered and is relayed as is;
`GovernorError` is everything the governor answers by itself — authentication, validation,
limits, its own availability — with OpenAI's error types.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from schemas.engine import APIError


@dataclass(eq=False)
class GovernorError(APIError):
    """A decision of the governor; `headers` go on the response (e.g. Retry-After)."""

    type: str = "invalid_request_error"
    headers: dict[str, str] = field(default_factory=dict)
    reason: str = "bad_request"


def bad_request(message: str, param: str | None, reason: str = "bad_request") -> GovernorError:
    return GovernorError(400, message, "invalid_request_error", param, reason=reason)


def unauthenticated(what: str = "API key") -> GovernorError:
    return GovernorError(401, f"Invalid or missing {what}.", "authentication_error",
                         reason="unauthenticated")


def not_found(message: str, param: str | None) -> GovernorError:
    return GovernorError(404, message, "not_found_error", param, reason="not_found")


def request_timeout(message: str) -> GovernorError:
    return GovernorError(408, message, "timeout_error", reason="body_timeout")


def too_large(limit: int) -> GovernorError:
    return GovernorError(413, f"request body above {limit} bytes", "invalid_request_error",
                         reason="body_too_large")


def rate_limited(reason: str, retry_after_s: float) -> GovernorError:
    seconds = max(1, math.ceil(retry_after_s))  # never earlier than the wait
    return GovernorError(429, f"Too many requests ({reason}); retry in {seconds} s.",
                         "rate_limit_error", headers={"Retry-After": str(seconds)},
                         reason=reason)


def unavailable(message: str, reason: str = "unavailable") -> GovernorError:
    return GovernorError(503, message, "server_error", reason=reason)


def internal_error() -> GovernorError:
    return GovernorError(500, "internal error in the governor (logged)", "server_error",
                         reason="internal_error")
