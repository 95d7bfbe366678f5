"""Tenant class → engine priority and admission rank (docs/design.md §3).

Classes are ordered from soonest to latest. The admission rank is the index in that order
(0 = admitted first) and is used by the governor's own queue whatever the engine supports.
The engine value is the rank's distance from the baseline class, signed for the engine's
direction, so the baseline class maps to 0 — vLLM's default — and a request sent without
a priority competes as the baseline class. No value is emitted when the engine lacks
`priority_scheduling` (vLLM V1 silently ignores priority under FCFS,
docs/reference/vllm-surfaces.md §1.3).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from schemas.engine import EngineCapabilities, PriorityDirection

DEFAULT_CLASSES = ("interactive", "standard", "batch", "background")
DEFAULT_BASELINE = "standard"
_CLASS_NAME = re.compile(r"[a-z][a-z0-9_-]{0,63}")


@dataclass(frozen=True, slots=True)
class PriorityConfig:
    """Tenant classes, soonest first, and the class whose engine priority is 0."""

    classes: tuple[str, ...] = DEFAULT_CLASSES
    baseline: str = DEFAULT_BASELINE

    def __post_init__(self) -> None:
        if not self.classes:
            raise ValueError("at least one tenant class is required")
        for name in self.classes:
            if not isinstance(name, str) or not _CLASS_NAME.fullmatch(name):
                raise ValueError(f"bad tenant class name {name!r}: use [a-z][a-z0-9_-]*")
        if len(set(self.classes)) != len(self.classes):
            raise ValueError(f"duplicate tenant classes in {self.classes}")
        if self.baseline not in self.classes:
            raise ValueError(f"baseline class {self.baseline!r} is not one of {self.classes}")


def admission_rank(config: PriorityConfig, tenant_class: str) -> int:
    """Position of the class in the governor's queue order; 0 is admitted first."""
    try:
        return config.classes.index(tenant_class)
    except ValueError:
        raise ValueError(
            f"unknown tenant class {tenant_class!r}; known: {', '.join(config.classes)}"
        ) from None


def engine_priority(
    config: PriorityConfig, tenant_class: str, capabilities: EngineCapabilities
) -> int | None:
    """The engine's priority value for the class, or None when the engine cannot honour it."""
    offset = admission_rank(config, tenant_class) - admission_rank(config, config.baseline)
    if not capabilities.priority_scheduling:
        return None
    if capabilities.priority_direction is PriorityDirection.LOWER_IS_SOONER:
        return offset
    return -offset
