"""EngineConfig: the one validated configuration of the native engine's mechanics."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from policies.eviction import RestoreRates

if TYPE_CHECKING:
    from native_engine.model.runner import RunnerConfig

SchedulingPolicy = Literal["fcfs", "priority"]


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Scheduler, KV-pool and cache settings, plus what the model runner is built from.

    `num_blocks` blocks of `block_size` tokens make the KV pool. One step runs at most
    `max_num_seqs` requests and `max_num_batched_tokens` tokens; a prompt longer than the
    remaining budget is chunked when `enable_chunked_prefill` (else it waits for a step with
    room). `long_prefill_token_threshold` > 0 caps one request's chunk per step.
    `max_model_len` bounds prompt + max_tokens (None: the pool size; the engine also caps it
    at the model's position limit). `model` is a GGUF/HF path (None: the embedded model).

    Lower KV tiers (native_engine.kvcache.tiers), vLLM's flag names: `kv_offloading_size` GiB
    of host RAM, and a disk tier of `kv_disk_size` GiB under `kv_disk_dir`; both off when
    unset. `kv_restore_rates` None measures the restore and prefill rates at start-up.

    `cache_shares` reserves, per cache group (a tenant), that fraction of the pool's blocks
    for its cached prefixes: another group's allocations never evict it below (SEC-9).
    """

    block_size: int = 16
    num_blocks: int = 1024
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    scheduling_policy: SchedulingPolicy = "fcfs"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    max_model_len: int | None = None
    seed: int = 0
    model: str | None = None
    dtype: str = "auto"
    attention_backend: str = "auto"
    device: str = "cpu"
    kv_offloading_size: float | None = None
    kv_disk_dir: str | None = None
    kv_disk_size: float | None = None
    kv_restore_rates: RestoreRates | None = None
    cache_shares: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        positive = ("block_size", "num_blocks", "max_num_batched_tokens", "max_num_seqs")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}"
            )
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.max_model_len is not None and self.max_model_len > self.pool_tokens:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the KV pool "
                f"({self.pool_tokens} tokens)"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.model_len:
            raise ValueError(
                "without chunked prefill max_num_batched_tokens must cover max_model_len"
            )
        self._check_tiers()
        self._check_shares()

    def _check_shares(self) -> None:
        groups = [g for g, _ in self.cache_shares]
        if len(set(groups)) != len(groups):
            raise ValueError("cache_shares names a group twice")
        for group, share in self.cache_shares:
            if not isinstance(group, str) or not group or isinstance(share, bool) or not \
                    isinstance(share, int | float) or not 0 < share <= 1:
                raise ValueError(f"cache share of {group!r} must be in (0, 1], got {share!r}")
        if sum(s for _, s in self.cache_shares) > 1:
            raise ValueError("cache shares add up to more than the whole pool")

    def reserved_blocks(self) -> dict[str, int]:
        """Blocks each cache group keeps (its share of the pool, rounded down)."""
        return {g: int(share * self.num_blocks) for g, share in self.cache_shares}

    def _check_tiers(self) -> None:
        for name in ("kv_offloading_size", "kv_disk_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                      or not math.isfinite(value) or value <= 0):
                raise ValueError(f"{name} must be a number of GiB > 0, got {value!r}")
        if (self.kv_disk_dir is None) != (self.kv_disk_size is None):
            raise ValueError("kv_disk_dir and kv_disk_size go together")
        if self.kv_disk_dir is not None and not (isinstance(self.kv_disk_dir, str)
                                                 and self.kv_disk_dir):
            raise ValueError("kv_disk_dir must be a non-empty path")
        if self.tiered and not self.enable_prefix_caching:
            raise ValueError("KV tiers need prefix caching")
        if self.kv_restore_rates is not None and not isinstance(self.kv_restore_rates,
                                                                RestoreRates):
            raise ValueError("kv_restore_rates must be a policies.eviction.RestoreRates")

    @property
    def tiered(self) -> bool:
        """Whether any KV tier below the device pool is configured."""
        return self.kv_offloading_size is not None or self.kv_disk_dir is not None

    @property
    def pool_tokens(self) -> int:
        return self.block_size * self.num_blocks

    @property
    def model_len(self) -> int:
        return self.max_model_len if self.max_model_len is not None else self.pool_tokens

    def runner_config(self, **overrides: Any) -> RunnerConfig:
        """The model runner's config for this pool (block_size and num_blocks must agree)."""
        from native_engine.model.runner import RunnerConfig

        return RunnerConfig(
            model_path=self.model,
            dtype=self.dtype,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            attention_backend=self.attention_backend,
            device=self.device,
            **overrides,
        )
