"""Building the lower KV tiers for an engine, and measuring what a restore costs here.

`build_tiers` turns EngineConfig's `kv_offloading_size` / `kv_disk_dir` / `kv_disk_size` into
a native_engine.kvcache.tiers.TieredKV over the runner's KV. Unless the config carries
`kv_restore_rates`, `calibrate` measures them first, on this machine, with the real paths:

- prefill tokens/s: forwards of one chunk (at most `max_num_batched_tokens`, 128 tokens) into
  the still-empty pool (no holder reads those blocks; their next owner overwrites them);
- host restore bytes/s: read the chunk's KV to host memory, then time the promotion path
  (concatenate the blocks, write them into pool slots);
- disk restore bytes/s: write the blocks as tier files in a scratch directory, drop them from
  the page cache, then time read + full verification + write into pool slots.

Each figure is the median of a few runs. The tier decisions (`policies.eviction.restore_pays`)
use them; they are logged at start-up and exported by `fak engine serve`'s /metrics.
"""

from __future__ import annotations

import logging
import os
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from native_engine.config import EngineConfig
from native_engine.kvcache.block_hash import NONE_HASH, prompt_digests
from native_engine.kvcache.disk_tier import DiskTier, KVLayout
from native_engine.kvcache.tier_entry import MEDIUM_CPU, MEDIUM_DISK, TierEntry
from native_engine.kvcache.tier_types import TierConfig, TierEventSink
from native_engine.kvcache.tiers import TieredKV
from policies.eviction import RestoreRates

log = logging.getLogger("fak.engine.tiers")

GIB = 1 << 30
CALIBRATION_TOKENS = 128
CALIBRATION_RUNS = 3


def kv_layout(runner: Any) -> KVLayout:
    from native_engine.model.loaded import dtype_name

    cfg = runner.model_config
    return KVLayout(runner.model_digest, dtype_name(runner.dtype), runner.block_size,
                    cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)


def build_tiers(config: EngineConfig, runner: Any, events: Any = None) -> TieredKV | None:
    """The configured tiers over `runner`'s KV (None when none is configured)."""
    if not config.tiered:
        return None
    layout = kv_layout(runner)
    disk_dir = Path(config.kv_disk_dir).expanduser() if config.kv_disk_dir else None
    host_blocks = int((config.kv_offloading_size or 0) * GIB // layout.block_bytes)
    if config.kv_offloading_size is not None and host_blocks < 1:
        raise ValueError(f"kv_offloading_size {config.kv_offloading_size} GiB holds no KV "
                         f"block ({layout.block_bytes} bytes)")
    try:
        rates = config.kv_restore_rates or calibrate(runner, layout, config, disk_dir)
        tier_config = TierConfig(rates, host_blocks, disk_dir,
                                 int((config.kv_disk_size or 0) * GIB),
                                 pin_memory=runner.device.type == "cuda")
        sink = events if isinstance(events, TierEventSink) else None
        tiers = TieredKV(tier_config, layout, runner, sink, getattr(events, "root", NONE_HASH))
    except OSError as exc:
        raise ValueError(f"kv_disk_dir {disk_dir} is not usable: {exc}") from exc
    log.info("KV tiers: %s; prefill %.0f tokens/s%s", describe(tiers), rates.prefill_tokens_per_s,
             "" if config.kv_restore_rates else " (measured)")
    return tiers


def describe(tiers: TieredKV) -> str:
    parts = []
    for s in tiers.stats():
        rate = f"{s.restore_bytes_per_s / 1e6:.0f} MB/s" if s.restore_bytes_per_s else "no rate"
        verdict = "restore" if s.restore_pays else "recompute (restore is slower)"
        parts.append(f"{s.medium} {s.capacity_bytes / GIB:.2f} GiB, {rate}: {verdict}")
    return "; ".join(parts)


def _median_seconds(fn: Callable[[], object], runs: int = CALIBRATION_RUNS) -> float:
    fn()  # warm-up
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return max(statistics.median(times), 1e-9)


def calibrate(runner: Any, layout: KVLayout, config: EngineConfig,
              disk_dir: Path | None) -> RestoreRates:
    """Measure prefill tokens/s and restore bytes/s of the configured tiers (module doc)."""
    from native_engine.model.runner import RunnerBatch

    bs = layout.block_size
    num_blocks = max(1, min(CALIBRATION_TOKENS, config.max_num_batched_tokens,
                            runner.num_slots - bs) // bs)
    tokens = num_blocks * bs
    vocab = runner.model_config.vocab_size
    ids = [(7 + 31 * i) % vocab for i in range(tokens)]
    batch = RunnerBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.arange(tokens, dtype=torch.int64),
        slot_mapping=torch.arange(tokens, dtype=torch.int64),
        block_tables=torch.arange(num_blocks, dtype=torch.int32).unsqueeze(0),
        query_start_loc=torch.tensor([0, tokens], dtype=torch.int32),
        context_lens=torch.tensor([tokens], dtype=torch.int32))
    prefill = tokens / _median_seconds(lambda: runner.execute(batch))
    slots = torch.arange(tokens, dtype=torch.int64)
    blocks = list(runner.read_kv(slots).split(bs, dim=2))
    nbytes = num_blocks * layout.block_bytes
    rates = {MEDIUM_CPU: nbytes / _median_seconds(
        lambda: runner.write_kv(slots, torch.cat(blocks, dim=2)))}
    if disk_dir is not None:
        rates[MEDIUM_DISK] = nbytes / _disk_restore_seconds(runner, layout, disk_dir, ids,
                                                            blocks, slots)
    return RestoreRates(prefill, rates)


def _disk_restore_seconds(runner: Any, layout: KVLayout, disk_dir: Path, ids: list[int],
                          blocks: list[torch.Tensor], slots: torch.Tensor) -> float:
    scratch = disk_dir / f".calibration-{os.getpid()}"
    bs = layout.block_size
    disk = None
    try:
        disk = DiskTier(scratch, layout, (len(blocks) + 1) * (layout.block_bytes + 8192),
                        max_pending=len(blocks))
        digests = prompt_digests(None, ids, bs)
        entries = [TierEntry(d, digests[k - 1] if k else None, tuple(ids[k * bs:(k + 1) * bs]),
                             None, True, layout.block_bytes) for k, d in enumerate(digests)]
        for entry, kv in zip(entries, blocks, strict=True):
            disk.write(entry, kv)
        disk.drain()
        if disk.reap() or disk.num_pending:
            raise OSError(f"cannot write KV files under {disk_dir}")

        def restore() -> None:
            for entry in entries:  # cold: out of the page cache, as after a restart
                _drop_page_cache(disk.path_of(entry.digest))
            kvs = [disk.read(e.digest, e.parent, e.token_ids) for e in entries]
            if any(kv is None for kv in kvs):
                raise OSError("calibration KV files did not verify")
            runner.write_kv(slots, torch.cat(kvs, dim=2))  # type: ignore[arg-type]

        return _median_seconds(restore)
    finally:
        if disk is not None:
            disk.close()
        shutil.rmtree(scratch, ignore_errors=True)


def _drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
