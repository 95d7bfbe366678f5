"""The audit's report: every sample, each phase's statistics, the verdict; as JSON and as the
lines the command prints. No prompt text and no key is kept (the prompts are random anyway)."""

from __future__ import annotations

import dataclasses
import json
import platform
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from governor.isolation.config import AuditConfig
from policies.isolation_audit import PHASES, Phase, PhaseStats, phase_stats, verdict

REPORT_VERSION = 1


@dataclass(frozen=True, slots=True)
class Sample:
    """One trial: the probe's TTFT and usage counts, and the plant's TTFT (always cold)."""

    index: int
    phase: Phase
    kind: str
    ttft_s: float
    prompt_tokens: int | None
    cached_tokens: int | None
    plant_ttft_s: float


@dataclass(frozen=True, slots=True)
class AuditReport:
    config: dict[str, Any]
    model: str
    seed: int
    started_at: float
    duration_s: float
    phases: dict[str, PhaseStats]
    cached_tokens_median: dict[str, dict[str, float | None]]
    verdict: str
    samples: tuple[Sample, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "version": REPORT_VERSION, "method": "Gu et al. 2025 (arXiv 2502.07776), SEC-5",
            "verdict": self.verdict, "model": self.model, "seed": self.seed,
            "started_at": self.started_at, "duration_s": self.duration_s,
            "host": {"machine": platform.machine(), "python": platform.python_version()},
            "config": self.config,
            "phases": {name: dataclasses.asdict(s) for name, s in self.phases.items()},
            "cached_tokens_median": self.cached_tokens_median,
            "samples": [dataclasses.asdict(s) for s in self.samples],
        }

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")

    def lines(self) -> list[str]:
        out = [f"fak audit isolation: {self.config['base_url']} model {self.model}, "
               f"{self.config['samples']} hit + {self.config['samples']} miss per phase, "
               f"{self.config['prompt_tokens']} tokens, prefix fraction "
               f"{self.config['prefix_fraction']}, seed {self.seed}, {self.duration_s:.1f} s"]
        for name, label in (("cross", "cross-tenant (A plants, B probes)"),
                            ("control", "same-tenant control (A plants, A probes)")):
            s = self.phases[name]
            cached = self.cached_tokens_median[name]
            out.append(
                f"  {label}: KS p = {s.p_value:.3g} (D = {s.ks_statistic:.3f}); TTFT median "
                f"hit {s.median_hit_s * 1e3:.1f} ms, miss {s.median_miss_s * 1e3:.1f} ms "
                f"({s.median_ratio:.2f}x); hits faster than every miss: "
                f"{s.share_faster:.0%}; cached tokens median hit {cached['hit']}, "
                f"miss {cached['miss']}")
        out.append(f"verdict: {self.verdict}")
        return out


def build_report(config: AuditConfig, model: str, seed: int, started_at: float,
                 duration_s: float, samples: list[Sample]) -> AuditReport:
    phases: dict[str, PhaseStats] = {}
    cached: dict[str, dict[str, float | None]] = {}
    for phase in PHASES:
        mine = [s for s in samples if s.phase == phase]
        times = {k: [s.ttft_s for s in mine if s.kind == k] for k in ("hit", "miss")}
        phases[phase] = phase_stats(times["hit"], times["miss"])
        cached[phase] = {k: _median([s.cached_tokens for s in mine if s.kind == k])
                         for k in ("hit", "miss")}
    settings = dataclasses.asdict(config)
    for secret in ("key_a", "key_b"):
        settings.pop(secret)
    return AuditReport(settings, model, seed, started_at, duration_s, phases, cached,
                       verdict(phases["cross"], phases["control"], config.thresholds),
                       tuple(samples))


def _median(values: list[int | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None
