"""What one `fak bench overhead` run measures (kept apart from the runner so the CLI can
read its defaults without importing the benchmark machinery)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from governor.bench.config import BenchConfigError
from governor.config import ConfigError, load_config

DIRECT, GOVERNOR = "direct", "governor"


@dataclass(frozen=True, slots=True)
class OverheadConfig:
    engine: str
    config: Path
    out: Path = Path("fak-bench-overhead")
    concurrency: tuple[int, ...] = (1, 16, 64)
    rounds: int = 7
    per_round: int = 25
    warmup: int = 15
    input_len: int = 32
    max_tokens: int = 16
    seed: int = 0
    model: str | None = None
    tokenizer: Path | None = None
    api_key_env: str = "FAK_BENCH_API_KEY"
    engine_log: Path | None = None
    engine_compile_cache: str | None = None
    max_cv: float = 0.10
    settle_max_busy: float = 0.2  # as `fak bench ab`'s: the machine quiet before each block
    settle_timeout_s: float = 15.0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.rounds < 2 or self.per_round < 1 or self.warmup < 1:
            raise BenchConfigError("rounds must be ≥ 2, per_round and warmup ≥ 1")
        if not self.concurrency or min(self.concurrency) < 1:
            raise BenchConfigError("concurrency levels must be ≥ 1")
        if self.input_len < 1 or self.max_tokens < 1:
            raise BenchConfigError("input_len and max_tokens must be ≥ 1")
        try:
            governed = load_config(self.config)
        except ConfigError as exc:
            raise BenchConfigError(str(exc)) from exc
        base = (governed.engine.base_url or "").rstrip("/")
        if governed.engine.kind != "vllm" or base != self.engine.rstrip("/"):
            raise BenchConfigError(
                f"--config {self.config} must govern --engine {self.engine} "
                f"([engine] kind = \"vllm\", base_url = \"{self.engine}\"), it has "
                f"kind={governed.engine.kind!r} base_url={governed.engine.base_url!r}")
