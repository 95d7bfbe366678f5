"""Llama-family decoder over a paged KV cache (flattened varlen batch).

Weights arrive in Hugging Face layout and names (see `hf_weight_shapes`); q/k/v and gate/up
are fused at load time so each layer runs three large matmuls plus the output projections.
Attention goes through a kernel module with the `store_kv` / `paged_attention` contract of
`native_engine.kernels.torch_ref`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from native_engine.kernels import cpu_native
from native_engine.kernels.linear import Linear, choose_linear


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama-family model (plain RoPE, RMSNorm, SiLU MLP, no biases)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"LlamaConfig.{name} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads (grouped-query)")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for rotary embeddings")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ValueError("rope_theta and rms_norm_eps must be positive")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LlamaConfig:
        return cls(**data)


def hf_weight_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a model needs, by Hugging Face name, with its shape."""
    h, d = config.hidden_size, config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (config.num_heads * d, h)
        shapes[p + "self_attn.k_proj.weight"] = (config.num_kv_heads * d, h)
        shapes[p + "self_attn.v_proj.weight"] = (config.num_kv_heads * d, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, config.num_heads * d)
        shapes[p + "mlp.gate_proj.weight"] = (config.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (config.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, config.intermediate_size)
    return shapes


def check_weights(config: LlamaConfig, weights: dict[str, torch.Tensor]) -> None:
    """Raise ValueError naming the first missing, unexpected or mis-shaped tensor."""
    expected = hf_weight_shapes(config)
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise ValueError(f"weights missing {len(missing)} tensors, e.g. {missing[0]!r}")
    extra = sorted(set(weights) - set(expected))
    if extra:
        raise ValueError(f"unexpected weight tensors, e.g. {extra[0]!r}")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"{name}: shape {tuple(weights[name].shape)}, expected {shape}")


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    exponents = torch.arange(0, config.head_dim, 2, dtype=torch.float32) / config.head_dim
    return 1.0 / (config.rope_theta ** exponents)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as one fused kernel. In fp32 it equals HF's LlamaRMSNorm (normalise, then
    scale) bit for bit (checked); in bf16 it rounds once after scaling, as vLLM's CPU kernel
    does, where HF rounds before scaling too. One kernel instead of six per call."""
    return F.rms_norm(x, weight.shape, weight, eps)


def rope_tables(config: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position, full-width cos and signed sin [max_pos, D] for `apply_rope`: the
    rotate-half form x * cos + cat(x2, x1) * (-sin, sin) in one pass over all heads."""
    freqs = torch.outer(
        torch.arange(config.max_position_embeddings, dtype=torch.float32),
        rope_inv_freq(config),
    )
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (HF layout). x: [T, H, D]; cos, sin: [T, 1, D] from `rope_tables`."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.addcmul(x * cos, torch.cat((x2, x1), dim=-1), sin)


@dataclass
class AttentionMetadata:
    """Per-step paged-attention inputs (see the kernel contract)."""

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: Linear
    o_proj: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear


class LlamaModel:
    """The decoder; `forward` runs a flattened batch, `compute_logits` the chosen rows."""

    def __init__(
        self,
        config: LlamaConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        kernels: ModuleType,
    ) -> None:
        check_weights(config, weights)
        self.config = config
        self.dtype = dtype
        self.device = device
        self.kernels = kernels
        self.scale = config.head_dim ** -0.5

        self.linear_kind = choose_linear(dtype, device)

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=device, dtype=dtype)

        self.embed = w("model.embed_tokens.weight")
        head = self.embed if config.tie_word_embeddings else w("lm_head.weight")
        self.lm_head = Linear(head, self.linear_kind)
        if config.tie_word_embeddings and self.lm_head.transposed:
            # The head's [in, out] copy holds the same numbers: looked up through a transposed
            # view, the model holds them once (gathering 1,000 prompt tokens' rows that way
            # took 9 ms instead of 1 ms, against seconds of prefill).
            self.embed = self.lm_head.weight.t()
        self.norm = w("model.norm.weight")
        self.layers = [self._load_layer(w, i) for i in range(config.num_layers)]
        cos, sin = rope_tables(config)
        self.rope_cos = cos.to(device=device, dtype=dtype)
        self.rope_sin = sin.to(device=device, dtype=dtype)
        # fak's C kernels fuse the elementwise steps on a CPU (float32 math, one rounding):
        # RoPE in place from float32 half-width tables, residual add + RMSNorm, SiLU * up.
        self.native = (cpu_native.load() if device.type == "cpu" and dtype in cpu_native.SUFFIX
                       else None)
        half = config.head_dim // 2  # rope_tables' halves repeat; sin's first half is -sin
        self.rope_cos_half = cos[:, :half].contiguous()
        self.rope_sin_half = sin[:, half:].contiguous()

    def _load_layer(self, w: Any, i: int) -> _Layer:
        p = f"model.layers.{i}."

        def linear(weight: torch.Tensor) -> Linear:
            return Linear(weight, self.linear_kind)

        return _Layer(
            input_norm=w(p + "input_layernorm.weight"),
            qkv=linear(torch.cat([w(p + f"self_attn.{n}_proj.weight") for n in "qkv"])),
            o_proj=linear(w(p + "self_attn.o_proj.weight")),
            post_norm=w(p + "post_attention_layernorm.weight"),
            gate_up=linear(torch.cat([w(p + "mlp.gate_proj.weight"),
                                      w(p + "mlp.up_proj.weight")])),
            down=linear(w(p + "mlp.down_proj.weight")),
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn: AttentionMetadata,
    ) -> torch.Tensor:
        """Final-normed hidden states [T, hidden]; stores every token's K/V on the way.

        Each layer adds its attention and MLP outputs to the residual stream `h` in place,
        and the norm after each add is fused with it (`_add_norm`)."""
        cfg = self.config
        t = input_ids.shape[0]
        step = self.kernels.plan(attn.slot_mapping, attn.block_tables, attn.query_start_loc,
                                 attn.context_lens, kv_caches[0][0].shape[1],
                                 num_blocks=kv_caches[0][0].shape[0])
        rope = self._rope_step(positions)
        num_qk = cfg.num_heads + cfg.num_kv_heads
        h = self.embed[input_ids]
        x = self._add_norm(h, None, self.layers[0].input_norm)
        norms = [layer.input_norm for layer in self.layers[1:]] + [self.norm]
        for layer, next_norm, (k_cache, v_cache) in zip(self.layers, norms, kv_caches,
                                                        strict=True):
            qkv = layer.qkv(x).view(t, num_qk + cfg.num_kv_heads, cfg.head_dim)
            qk = rope(qkv[:, :num_qk])  # q and k heads in one pass
            o = self.kernels.attend(qk[:, : cfg.num_heads], qk[:, cfg.num_heads :],
                                    qkv[:, num_qk:], k_cache, v_cache, step, self.scale)
            x = self._add_norm(h, layer.o_proj(o.reshape(t, -1)), layer.post_norm)
            x = self._add_norm(h, layer.down(self._swiglu(layer.gate_up(x))), next_norm)
        return x

    def _rope_step(self, positions: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """RoPE at this step's positions, for q and k heads [T, H, D] (checked once)."""
        if self.native is not None:
            native = self.native
            checked = cpu_native.Positions.checked(positions, self.rope_cos_half.shape[0])

            def rope_native(x: torch.Tensor) -> torch.Tensor:
                cpu_native.rope_(native, x, checked, self.rope_cos_half, self.rope_sin_half)
                return x

            return rope_native
        cos = self.rope_cos[positions].unsqueeze(1)
        sin = self.rope_sin[positions].unsqueeze(1)
        return lambda x: apply_rope(x, cos, sin)

    def _add_norm(self, h: torch.Tensor, delta: torch.Tensor | None,
                  weight: torch.Tensor) -> torch.Tensor:
        """`h += delta` in place (when given), then RMSNorm(h) * weight."""
        if self.native is not None:
            return cpu_native.add_rms_norm(self.native, h, delta, weight,
                                           self.config.rms_norm_eps)
        if delta is not None:
            h += delta
        return rms_norm(h, weight, self.config.rms_norm_eps)

    def _swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            return cpu_native.silu_mul(self.native, gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [R, vocab] for the given hidden rows, in the model's dtype (the sampler
        widens them to float32 where it needs more than an argmax)."""
        return self.lm_head(hidden)
