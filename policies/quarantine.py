"""Quarantine planning: which removal an engine can perform for a poisoned span (docs/design.md §3).

Preference, strongest first:

| capability       | plan               | degraded | reason                                    |
|------------------|--------------------|----------|-------------------------------------------|
| exact_span_evict | exact              | no       | exact_span_evict                          |
| prefix_reset     | whole_prefix_flush | yes      | exact_span_unsupported_whole_prefix_flush |
| cache_salt       | salt_rotation      | yes      | exact_span_unsupported_salt_rotation      |
| none of them     | refuse             | no       | no_quarantine_capability                  |

With `require_exact` any row but the first becomes `refuse` with reason
`exact_required_but_unsupported`: an exact request never degrades. A whole-prefix flush drops
every tenant's cache but removes the content; a salt rotation (tenant epoch bump) only makes
the tenant's old blocks unreachable, leaving them to age out — hence that order.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from schemas.engine import EngineCapabilities

REASON_EXACT = "exact_span_evict"
REASON_FLUSH = "exact_span_unsupported_whole_prefix_flush"
REASON_ROTATION = "exact_span_unsupported_salt_rotation"
REASON_EXACT_REQUIRED = "exact_required_but_unsupported"
REASON_NO_CAPABILITY = "no_quarantine_capability"
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


class PlanKind(enum.StrEnum):
    EXACT = "exact"
    WHOLE_PREFIX_FLUSH = "whole_prefix_flush"
    SALT_ROTATION = "salt_rotation"
    REFUSE = "refuse"


@dataclass(frozen=True, slots=True)
class QuarantineSpan:
    """The content to quarantine: whose cache, how many tokens, and a SHA-256 hex digest of
    the span (of its token ids or its text; the planner only carries it for the record)."""

    tenant: str
    token_count: int
    digest: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.tenant, str) or not self.tenant:
            raise ValueError("span tenant must be a non-empty string")
        if isinstance(self.token_count, bool) or not isinstance(self.token_count, int):
            raise TypeError("span token_count must be an int")
        if self.token_count < 1:
            raise ValueError(f"span token_count must be >= 1, got {self.token_count}")
        if self.digest is not None and not _SHA256_HEX.fullmatch(self.digest):
            raise ValueError("span digest must be 64 lowercase hex characters (SHA-256)")


@dataclass(frozen=True, slots=True)
class QuarantinePlan:
    kind: PlanKind
    span: QuarantineSpan
    degraded: bool
    reason: str
    require_exact: bool

    @property
    def refused(self) -> bool:
        return self.kind is PlanKind.REFUSE


def plan_quarantine(
    span: QuarantineSpan, capabilities: EngineCapabilities, require_exact: bool
) -> QuarantinePlan:
    """The one plan for this span on this engine (table in the module docstring)."""
    if capabilities.exact_span_evict:
        return QuarantinePlan(PlanKind.EXACT, span, False, REASON_EXACT, require_exact)
    if require_exact:
        return QuarantinePlan(PlanKind.REFUSE, span, False, REASON_EXACT_REQUIRED, True)
    if capabilities.prefix_reset:
        return QuarantinePlan(PlanKind.WHOLE_PREFIX_FLUSH, span, True, REASON_FLUSH, False)
    if capabilities.cache_salt:
        return QuarantinePlan(PlanKind.SALT_ROTATION, span, True, REASON_ROTATION, False)
    return QuarantinePlan(PlanKind.REFUSE, span, False, REASON_NO_CAPABILITY, False)
