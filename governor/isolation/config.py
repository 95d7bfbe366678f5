"""The one config record of `fak audit isolation`, validated once; the CLI's defaults."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from policies.isolation_audit import Thresholds

Route = Literal["completions", "chat"]


@dataclass(frozen=True, slots=True)
class AuditConfig:
    """One audit run. `samples` hit and `samples` miss trials per phase (Gu et al. used 250);
    `prompt_tokens` letters per prompt, of which `prefix_fraction` are shared by a hit;
    `warmup` discarded requests per key first; `interval_s` pause after every request."""

    base_url: str
    key_a: str
    key_b: str
    samples: int = 100
    prompt_tokens: int = 512
    prefix_fraction: float = 0.95
    seed: int | None = None
    model: str | None = None
    route: Route = "completions"
    warmup: int = 3
    interval_s: float = 0.0
    timeout_s: float = 120.0
    thresholds: Thresholds = field(default_factory=Thresholds)

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url must start with http:// or https://, "
                             f"got {self.base_url!r}")
        if not self.key_a or not self.key_b:
            raise ValueError("--key-a and --key-b must not be empty")
        if self.samples < 2:
            raise ValueError("--samples must be at least 2")
        if self.prompt_tokens < 2:
            raise ValueError("--prompt-tokens must be at least 2")
        if not 0 < self.prefix_fraction < 1:
            raise ValueError("--prefix-fraction must be in (0, 1)")
        if self.warmup < 0 or not (math.isfinite(self.interval_s) and self.interval_s >= 0):
            raise ValueError("--warmup and --interval must not be negative")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError("--timeout must be positive")
        if self.route not in ("completions", "chat"):
            raise ValueError(f"--route must be completions or chat, got {self.route!r}")
