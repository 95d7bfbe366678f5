"""Llama-family decoder over a paged KV cache (flattened varlen batch).

Weights arrive in Hugging Face layout and names (see `hf_weight_shapes`); q/k/v and gate/up
are fused at load time so each layer runs three large matmuls plus the output projections.
Attention goes through a kernel module with the `store_kv` / `paged_attention` contract of
`native_engine.kernels.torch_ref`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

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
        """Final-normed hidden states [T, hidden]; stores every token's K/V on the way."""
        cfg = self.config
        t = input_ids.shape[0]
        step = self.kernels.plan(attn.slot_mapping, attn.block_tables, attn.query_start_loc,
                                 attn.context_lens, kv_caches[0][0].shape[1],
                                 num_blocks=kv_caches[0][0].shape[0])
        cos = self.rope_cos[positions].unsqueeze(1)
        sin = self.rope_sin[positions].unsqueeze(1)
        num_qk = cfg.num_heads + cfg.num_kv_heads
        h = self.embed[input_ids]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x = rms_norm(h, layer.input_norm, cfg.rms_norm_eps)
            qkv = layer.qkv(x).view(t, num_qk + cfg.num_kv_heads, cfg.head_dim)
            qk = apply_rope(qkv[:, :num_qk], cos, sin)  # q and k heads in one pass
            o = self.kernels.attend(qk[:, : cfg.num_heads], qk[:, cfg.num_heads :],
                                    qkv[:, num_qk:], k_cache, v_cache, step, self.scale)
            h = h + layer.o_proj(o.reshape(t, -1))
            x = rms_norm(h, layer.post_norm, cfg.rms_norm_eps)
            gate, up = layer.gate_up(x).chunk(2, dim=-1)
            h = h + layer.down(F.silu(gate) * up)
        return rms_norm(h, self.norm, cfg.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [R, vocab] for the given hidden rows."""
        return self.lm_head(hidden).float()
