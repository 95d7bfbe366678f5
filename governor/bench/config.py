"""What one `fak bench ab` run measures: one config, validated once; the CLI's defaults
come from it, and a `--plan FILE` (TOML, the same keys with underscores) fills it too.

`run_id` seeds the prompts' content with the seed; a new one is drawn per run, so a re-run
never meets its own prompts in a server's cache. Giving an earlier run's id replays its
prompts exactly, and the cache check then refuses the comparison, as it should.

API keys are never flags (other users can read a command line): `api_key_env` names the
environment variable holding them, comma-separated when a workload uses several.
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

WORKLOADS = ("random", "prefix-repetition", "multi-turn", "tenant-mix")
METRICS = ("output_throughput", "request_throughput", "ttft.p50", "ttft.p99", "itl.p50",
           "itl.p99", "e2el.p50", "e2el.p99", "tpot.p50")
ARM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,31}$")
Order = Literal["interleaved", "sequential"]


class BenchConfigError(ValueError):
    """The benchmark cannot run as asked; the message names the setting."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise BenchConfigError(message)


@dataclass(frozen=True, slots=True)
class ArmSpec:
    """An OpenAI-compatible endpoint (no `/v1` suffix). `log`: the server's log file, read
    for request-time compilation; `compile_cache`: the operator's statement of the arm's
    compile-cache state, used only when the arm does not tell it itself."""

    name: str
    url: str
    log: Path | None = None
    compile_cache: str | None = None

    def __post_init__(self) -> None:
        _check(bool(ARM_NAME.match(self.name)), f"arm name {self.name!r}: 1-32 letters, digits, "
               "'_', '.', '-'")
        _check(self.url.startswith(("http://", "https://")),
               f"arm {self.name!r}: URL must start with http:// or https://, got {self.url!r}")
        _check(not self.url.rstrip("/").endswith("/v1"),
               f"arm {self.name!r}: give the server's base URL, without /v1")
        _check(self.compile_cache in (None, "warm", "cold", "disabled", "not_applicable"),
               f"arm {self.name!r}: compile_cache must be warm, cold, disabled or "
               f"not_applicable")
        object.__setattr__(self, "url", self.url.rstrip("/"))


@dataclass(frozen=True, slots=True)
class Level:
    """One load point: a client concurrency cap and/or a request rate (None = burst).
    `tag` names what the point measures (the overhead bench has several); `stream`: false
    sends non-streaming requests, whose whole answer is their latency."""

    concurrency: int | None
    request_rate: float | None
    tag: str = ""
    stream: bool = True

    @property
    def label(self) -> str:
        parts = [self.tag] if self.tag else []
        if self.concurrency is not None:
            parts.append(f"c{self.concurrency}")
        if self.request_rate is not None:
            parts.append(f"r{self.request_rate:g}")
        return "-".join(parts)


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """Lengths in tokens. `random`: input_len ± range_ratio, vLLM's random dataset;
    `prefix-repetition`: num_prefixes shared prefixes of prefix_len, suffixes of input_len;
    `multi-turn`: conversations of `turns` turns, each adding input_len user tokens and a
    replayed output_len assistant reply; `tenant-mix`: prefix-repetition whose prefixes
    every tenant (API key) uses."""

    name: str = "random"
    input_len: int = 256
    output_len: int = 64
    range_ratio: float = 0.0
    prefix_len: int = 256
    num_prefixes: int = 4
    turns: int = 3

    def __post_init__(self) -> None:
        _check(self.name in WORKLOADS, f"workload must be one of {', '.join(WORKLOADS)}")
        for name in ("input_len", "output_len", "prefix_len", "num_prefixes", "turns"):
            _check(isinstance(getattr(self, name), int) and getattr(self, name) >= 1,
                   f"{name} must be an integer ≥ 1")
        _check(0.0 <= self.range_ratio < 1.0, "range_ratio must be within [0, 1)")


@dataclass(frozen=True, slots=True)
class ABConfig:
    arms: tuple[ArmSpec, ...]
    out: Path
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    concurrency: tuple[int, ...] = (1,)
    request_rate: tuple[float, ...] = ()
    burstiness: float = 1.0
    blocks: int = 5
    requests_per_block: int | None = None
    requests_factor: float = 2.0
    min_requests: int = 8
    warmup_requests: int | None = None
    seed: int = 0
    order: Order = "interleaved"
    metric: str = "output_throughput"
    goodput: tuple[tuple[str, float], ...] = ()
    model: str | None = None
    tokenizer: Path | None = None
    api_key_env: str = "FAK_BENCH_API_KEY"
    through_governor: Path | None = None
    governor_arm: str = "governor"
    governor_compile_cache: str | None = None  # stated, when its engine is not an arm
    request_timeout_s: float = 1800.0
    max_cv: float = 0.10
    settle_max_busy: float = 0.2  # a block starts once all CPUs together are this idle…
    settle_timeout_s: float = 15.0  # …or this long has passed (then its pair is refused)
    bootstrap_resamples: int = 2000
    ratios: tuple[str, ...] = METRICS  # the B/A figures bootstrapped per pair
    run_id: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        names = [a.name for a in self.arms]
        wanted = len(names) + (self.through_governor is not None)
        _check(wanted >= 2, "an A/B run needs at least two arms (--arm NAME=URL, "
               "--through-governor CONFIG)")
        if self.through_governor is not None:
            names.append(self.governor_arm)
        _check(len(set(names)) == len(names), f"arm names must be unique: {names}")
        _check(all(c >= 1 for c in self.concurrency), "concurrency levels must be ≥ 1")
        _check(all(math.isfinite(r) and r > 0 for r in self.request_rate),
               "request rates must be finite and > 0")
        _check(bool(self.concurrency or self.request_rate),
               "give --concurrency levels or --request-rate values")
        _check(math.isfinite(self.burstiness) and self.burstiness > 0, "burstiness must be > 0")
        _check(self.blocks >= 2, "blocks must be ≥ 2 (5 or more for a claim)")
        _check(self.requests_per_block is None or self.requests_per_block >= 1,
               "requests_per_block must be ≥ 1")
        _check(self.requests_factor > 0 and self.min_requests >= 1,
               "requests_factor must be > 0 and min_requests ≥ 1")
        _check(self.warmup_requests is None or self.warmup_requests >= 1,
               "warmup_requests must be ≥ 1")
        _check(self.metric in METRICS, f"metric must be one of {', '.join(METRICS)}")
        _check(set(self.ratios) <= set(METRICS), f"ratios must be among {', '.join(METRICS)}")
        _check(all(k in ("ttft", "tpot", "e2el") and v > 0 for k, v in self.goodput),
               "goodput SLOs are ttft:MS, tpot:MS, e2el:MS with MS > 0")
        _check(self.request_timeout_s > 0, "request_timeout_s must be > 0")
        _check(0 < self.max_cv < 1, "max_cv must be within (0, 1)")
        _check(0 < self.settle_max_busy <= 1, "settle_max_busy must be within (0, 1]")
        _check(math.isfinite(self.settle_timeout_s) and self.settle_timeout_s >= 0,
               "settle_timeout_s must be ≥ 0 (0: no wait)")
        _check(self.bootstrap_resamples >= 100, "bootstrap_resamples must be ≥ 100")
        _check(bool(re.fullmatch(r"[A-Z_][A-Z0-9_]*", self.api_key_env)),
               "api_key_env must name an environment variable")
        _check(self.run_id is None or bool(re.fullmatch(r"[0-9a-f]{8,64}", self.run_id)),
               "run_id must be 8-64 lowercase hex digits")

    def levels(self) -> tuple[Level, ...]:
        """Concurrency levels (burst), or request rates (capped by each concurrency level
        when both are given)."""
        if not self.request_rate:
            return tuple(Level(c, None) for c in self.concurrency)
        caps: tuple[int | None, ...] = self.concurrency or (None,)
        return tuple(Level(c, r) for c in caps for r in self.request_rate)

    def requests_for(self, level: Level) -> int:
        """Per block: given, else requests_factor × concurrency, at least min_requests
        (multi-turn counts turns)."""
        if self.requests_per_block is not None:
            return self.requests_per_block
        return max(self.min_requests, round(self.requests_factor * (level.concurrency or 4)))

    def warmup_for(self, level: Level) -> int:
        return self.warmup_requests or max(2, level.concurrency or 2)


def parse_arm(text: str) -> tuple[str, str]:
    name, sep, url = text.partition("=")
    _check(bool(sep and name and url), f"--arm wants NAME=URL, got {text!r}")
    return name, url


def parse_goodput(items: list[str]) -> tuple[tuple[str, float], ...]:
    out = []
    for item in items:
        key, sep, value = item.partition(":")
        try:
            out.append((key, float(value)))
        except ValueError:
            sep = ""
        _check(bool(sep), f"--goodput wants KEY:MS (ttft, tpot, e2el), got {item!r}")
    return tuple(out)


def load_plan_file(path: Path) -> dict[str, Any]:
    """A plan's settings (TOML). `arms` is a table NAME = URL, or NAME = {url, log,
    compile_cache}."""
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise BenchConfigError(f"cannot read plan {path}: {exc}") from exc
    known = {f.name for f in fields(ABConfig)} | {f.name for f in fields(WorkloadConfig)}
    unknown = sorted(set(raw) - known - {"workload_name"})
    _check(not unknown, f"plan {path}: unknown keys {unknown}")
    return raw


def arms_from(raw: Any) -> tuple[ArmSpec, ...]:
    _check(isinstance(raw, dict), "arms must be a table NAME = URL")
    arms = []
    for name, value in raw.items():
        if isinstance(value, str):
            arms.append(ArmSpec(name, value))
            continue
        _check(isinstance(value, dict) and isinstance(value.get("url"), str),
               f"arm {name!r}: give a URL or {{url = ..., log = ..., compile_cache = ...}}")
        log = value.get("log")
        arms.append(ArmSpec(name, value["url"], Path(log) if log else None,
                            value.get("compile_cache")))
    return tuple(arms)


def with_arm_details(arms: tuple[ArmSpec, ...], logs: dict[str, str],
                     compile_cache: dict[str, str], governor_arm: str | None = None
                     ) -> tuple[ArmSpec, ...]:
    known = {a.name for a in arms}
    stray = sorted((set(logs) - known) | (set(compile_cache) - known - {governor_arm}))
    _check(not stray, f"--arm-log/--arm-compile-cache name unknown arms: {stray}")
    return tuple(replace(a, log=Path(logs[a.name]) if a.name in logs else a.log,
                         compile_cache=compile_cache.get(a.name, a.compile_cache))
                 for a in arms)


def jsonable(config: Any) -> dict[str, Any]:
    """The config as plain JSON values, for the plan file."""
    def value(v: Any) -> Any:
        if isinstance(v, Path):
            return str(v)
        if isinstance(v, tuple):
            return [value(x) for x in v]
        if hasattr(v, "__dataclass_fields__"):
            return {f.name: value(getattr(v, f.name)) for f in fields(v)}
        return v

    return {f.name: value(getattr(config, f.name)) for f in fields(config)
            if f.name not in ("progress",)}
