"""ModelRunner: the model, its paged KV caches, and one `execute` per scheduler step.

KV caches are per layer `(k_cache, v_cache)`, each [num_blocks, block_size, Hkv, D] in the
compute dtype. A slot is `block * block_size + offset`. Everything outside the model reaches
the KV through `slot_views` (copy, read and write by slot), so a layout change is one edit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from native_engine.kernels import BACKENDS, cpu_native, select_backend
from native_engine.kernels.cpu_features import CPU_FLAGS
from native_engine.model.llama import AttentionMetadata, LlamaModel
from native_engine.model.loaded import DTYPES, LoadedModel, dtype_name, weights_digest
from native_engine.model.machine import (
    ComputeChoice,
    auto_dtype,
    default_num_threads,
    reported_flags,
)
from native_engine.model.weights import load_model

DTYPE_CHOICES = ("auto", *DTYPES)
DEFAULT_KV_CACHE_BYTES = 256 * 1024 * 1024
log = logging.getLogger(__name__)


@dataclass
class RunnerConfig:
    """How to build a ModelRunner. `num_blocks` wins over `kv_cache_bytes` when both set;
    `num_threads` None means `default_num_threads()` (torch's thread count is process-wide)."""

    model_path: str | None = None
    dtype: str = "auto"
    num_blocks: int | None = None
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    block_size: int = 16
    attention_backend: str = "auto"
    device: str = "cpu"
    num_threads: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {self.dtype!r}")
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {BACKENDS}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        if self.kv_cache_bytes <= 0:
            raise ValueError("kv_cache_bytes must be positive")
        if self.num_threads is not None and self.num_threads <= 0:
            raise ValueError("num_threads must be positive")


@dataclass
class RunnerBatch:
    """One step's tokens for R requests, flattened to T tokens.

    input_ids, positions, slot_mapping: [T] int64. block_tables: [R, max_blocks] int32
    (padded with 0). query_start_loc: [R+1] int32, request r owns tokens
    [query_start_loc[r], query_start_loc[r+1]) (at least one). context_lens: [R] int32,
    tokens cached + new per request. logits_rows: [S] int64, the requests (ascending, in
    [0, R)) whose next-token logits are wanted; None means every request.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    logits_rows: torch.Tensor | None = None

    def check(self, num_slots: int, max_positions: int) -> None:
        """Raise ValueError on shapes, dtypes or indices the kernels cannot take."""
        t = self.input_ids.shape[0]
        r = self.context_lens.shape[0]
        for name in ("input_ids", "positions", "slot_mapping"):
            tensor = getattr(self, name)
            if tensor.dtype != torch.int64 or tuple(tensor.shape) != (t,):
                raise ValueError(f"{name} must be int64 of shape [{t}]")
        if self.block_tables.dtype != torch.int32 or self.block_tables.dim() != 2 \
                or self.block_tables.shape[0] != r:
            raise ValueError(f"block_tables must be int32 of shape [{r}, max_blocks]")
        starts = self.query_start_loc
        if starts.dtype != torch.int32 or tuple(starts.shape) != (r + 1,):
            raise ValueError(f"query_start_loc must be int32 of shape [{r + 1}]")
        if self.context_lens.dtype != torch.int32:
            raise ValueError("context_lens must be int32")
        if t == 0 or r == 0:
            raise ValueError("a batch needs at least one request and one token")
        if int(starts[0]) != 0 or int(starts[-1]) != t or bool((starts.diff() <= 0).any()):
            raise ValueError("query_start_loc must rise strictly from 0 to T")
        if bool((self.context_lens < starts.diff()).any()):
            raise ValueError("context_lens must cover each request's new tokens")
        if int(self.positions.min()) < 0 or int(self.positions.max()) >= max_positions:
            raise ValueError(f"positions must lie in [0, {max_positions})")
        if int(self.slot_mapping.max()) >= num_slots:
            raise ValueError(f"slot_mapping beyond the {num_slots} KV slots")
        rows = self.logits_rows
        if rows is not None and (
            rows.dtype != torch.int64 or rows.dim() != 1
            or (rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= r
                                  or bool((rows.diff() <= 0).any())))
        ):
            raise ValueError(f"logits_rows must be ascending int64 request indices in [0, {r})")


class ModelRunner:
    """Owns the model and KV caches; `execute` returns next-token logits per request."""

    def __init__(self, config: RunnerConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.device = torch.device(config.device)
        num_threads = config.num_threads or default_num_threads()
        torch.set_num_threads(num_threads)
        self.dtype = auto_dtype(self.device) if config.dtype == "auto" else DTYPES[config.dtype]
        loaded = loaded or load_model(config.model_path, self.dtype)
        self.model_config = loaded.config
        self.model_digest = loaded.digest or weights_digest(loaded.weights)
        self.tokenizer = loaded.tokenizer
        self.chat_template = loaded.chat_template
        self.stop_token_ids = loaded.tokenizer.stop_token_ids
        kernels = select_backend(config.attention_backend, self.device)
        self.model = LlamaModel(loaded.config, loaded.weights, self.dtype, self.device, kernels)
        decode_dtype = getattr(kernels, "decode_dtype", lambda dtype, device: dtype)
        self.compute = ComputeChoice(
            device=self.device.type, dtype=dtype_name(self.dtype),
            attention=kernels.__name__.rsplit(".", 1)[-1],
            decode_attention_dtype=dtype_name(decode_dtype(self.dtype, self.device)),
            linear=self.model.linear_kind,
            num_threads=num_threads, cpu_capability=torch.backends.cpu.get_cpu_capability(),
            flags=reported_flags(CPU_FLAGS),
            few_rows_linear=self.model.lm_head.few_rows_kernel,
            wide_threads=cpu_native.WIDE_THREADS if cpu_native.load() is not None
            and self.device.type == "cpu" else num_threads)
        log.info("%s", self.compute.describe())
        self.block_size = config.block_size
        self.num_blocks = config.num_blocks or max(1, config.kv_cache_bytes // self.block_bytes())
        self.kv_caches = self._allocate_kv()

    def block_bytes(self) -> int:
        """KV bytes one block takes across all layers (K and V)."""
        cfg = self.model_config
        per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
        return per_token * self.block_size * torch.finfo(self.dtype).bits // 8

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_model_len(self) -> int:
        return self.model_config.max_position_embeddings

    def _allocate_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        cfg = self.model_config
        shape = (self.num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        return [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(cfg.num_layers)
        ]

    def check_integrity(self) -> None:
        """Invariant: one (K, V) pair per layer, each [num_blocks, block_size, Hkv, D] in the
        runner's dtype on its device; the model shares that dtype and device."""
        cfg = self.model_config
        shape = (self.num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        assert len(self.kv_caches) == cfg.num_layers
        for pair in self.kv_caches:
            for cache in pair:
                assert tuple(cache.shape) == shape and cache.dtype == self.dtype
                assert cache.device.type == self.device.type
        assert self.model.dtype == self.dtype and self.model.embed.dtype == self.dtype

    @torch.inference_mode()
    def execute(self, batch: RunnerBatch) -> torch.Tensor:
        """Logits [S, vocab] (the model's dtype) for the last scheduled token of each request in
        `batch.logits_rows` (all R requests when None); the LM head runs on those rows only."""
        batch.check(self.num_slots, self.max_model_len)
        dev = self.device
        attn = AttentionMetadata(
            slot_mapping=batch.slot_mapping.to(dev),
            block_tables=batch.block_tables.to(dev),
            query_start_loc=batch.query_start_loc.to(dev),
            context_lens=batch.context_lens.to(dev),
        )
        hidden = self.model.forward(batch.input_ids.to(dev), batch.positions.to(dev),
                                    self.kv_caches, attn)
        last_rows = batch.query_start_loc[1:].to(torch.int64) - 1
        if batch.logits_rows is not None:
            last_rows = last_rows[batch.logits_rows]
        return self.model.compute_logits(hidden[last_rows.to(dev)])

    def slot_views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, (K, V) viewed as [num_slots, Hkv, D]: the one accessor by slot."""
        return [(k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])) for k, v in self.kv_caches]

    @torch.inference_mode()
    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the KV of slots `src` into slots `dst` in every layer."""
        if src.shape != dst.shape or src.dim() != 1:
            raise ValueError("src and dst must be 1-D and of equal length")
        src, dst = src.to(self.device, torch.int64), dst.to(self.device, torch.int64)
        for pair in self.slot_views():
            for flat in pair:
                flat[dst] = flat[src]

    @torch.inference_mode()
    def read_slots(self, slots: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, copies of (K, V) at `slots`, each [len(slots), Hkv, D]."""
        index = slots.to(self.device, torch.int64)
        return [(k[index].clone(), v[index].clone()) for k, v in self.slot_views()]

    @torch.inference_mode()
    def read_kv(self, slots: torch.Tensor) -> torch.Tensor:
        """The KV at `slots` as one host tensor [layers, 2, len(slots), Hkv, D]."""
        index = slots.to(self.device, torch.int64)
        views = self.slot_views()
        out = torch.empty((len(views), 2, index.shape[0], *views[0][0].shape[1:]),
                          dtype=self.dtype, device=self.device)
        for layer, (k, v) in enumerate(views):
            torch.index_select(k, 0, index, out=out[layer, 0])
            torch.index_select(v, 0, index, out=out[layer, 1])
        return out.to("cpu")

    @torch.inference_mode()
    def write_kv(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Write `kv` ([layers, 2, len(slots), Hkv, D], as read_kv returns) into `slots`."""
        views = self.slot_views()
        if kv.dim() != 5 or kv.shape[0] != len(views) or kv.shape[1] != 2 \
                or kv.shape[2] != slots.shape[0]:
            raise ValueError(f"KV of shape {tuple(kv.shape)} does not fit {slots.shape[0]} "
                             f"slots of {len(views)} layers")
        index = slots.to(self.device, torch.int64)
        kv = kv.to(self.device, self.dtype, non_blocking=True)
        for layer, (k, v) in enumerate(views):
            k.index_copy_(0, index, kv[layer, 0])
            v.index_copy_(0, index, kv[layer, 1])
