"""vLLM error bodies and transport failures as `schemas.engine.EngineError`.

vLLM ≥ 0.10.1 answers `{"error": {"message", "type", "param", "code"}}`; earlier releases a
flat `{"object": "error", "message", "type", "param", "code"}` (docs/reference/vllm-surfaces.md
§1.7). Both
are passed through with the upstream status. Transport failures become 502 (refused, reset,
broken stream) or 504 (timeouts), OpenAI-style; a connect that was refused or timed out is
an `EngineNotReached` (the request never reached the engine).
"""

from __future__ import annotations

import json
from typing import Any

from schemas.engine import EngineError

UPSTREAM_UNAVAILABLE = "UpstreamUnavailableError"
UPSTREAM_TIMEOUT = "UpstreamTimeoutError"
_MAX_TEXT = 2000


def _error_fields(body: Any) -> dict[str, Any] | None:
    if not isinstance(body, dict):
        return None
    nested = body.get("error")
    if isinstance(nested, dict) and isinstance(nested.get("message"), str):
        return nested
    if body.get("object") == "error" and isinstance(body.get("message"), str):
        return body
    return None


def error_from_body(status: int, raw: bytes) -> EngineError:
    """Decode an upstream error response; unknown bodies keep the status and a text excerpt."""
    try:
        fields = _error_fields(json.loads(raw))
    except (ValueError, UnicodeDecodeError):
        fields = None
    if fields is None:
        text = raw[:_MAX_TEXT].decode("utf-8", errors="replace")
        return EngineError(
            status=status, message=text or f"upstream answered {status}", type="UpstreamError"
        )
    code = fields.get("code")
    param = fields.get("param")
    return EngineError(
        status=status,
        message=fields["message"],
        type=str(fields.get("type") or "UpstreamError"),
        param=param if isinstance(param, str) else None,
        code=code if isinstance(code, int) and not isinstance(code, bool) else status,
    )


def unavailable(detail: str) -> EngineError:
    return EngineError(
        status=502, message=f"engine unavailable: {detail}", type=UPSTREAM_UNAVAILABLE
    )


def timed_out(detail: str) -> EngineError:
    return EngineError(status=504, message=f"engine timed out: {detail}", type=UPSTREAM_TIMEOUT)


class EngineNotReached(EngineError):
    """The request never reached the engine: its connect was refused or timed out, or the
    driver held it back (the engine failed its re-probe)."""


def connect_failed(detail: str) -> EngineError:
    return EngineNotReached(
        status=502, message=f"engine unavailable: {detail}", type=UPSTREAM_UNAVAILABLE
    )


def connect_timed_out() -> EngineError:
    return EngineNotReached(status=504, message="engine timed out: connect timed out",
                            type=UPSTREAM_TIMEOUT)
