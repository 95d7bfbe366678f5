"""Plain single-sequence Llama forward: no cache, float32, dense causal attention.

It shares nothing with the paged path but the weights, so it serves as the correctness
oracle for `LlamaModel` + `ModelRunner`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from native_engine.model.llama import LlamaConfig, check_weights


class ReferenceModel:
    def __init__(self, config: LlamaConfig, weights: dict[str, torch.Tensor]) -> None:
        check_weights(config, weights)
        self.config = config
        self.w = {k: v.float() for k, v in weights.items()}
        head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        self.lm_head = self.w[head]

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        var = (x * x).mean(dim=-1, keepdim=True)
        return x / torch.sqrt(var + self.config.rms_norm_eps) * self.w[name]

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [H, T, D]; HF rotate-half RoPE computed from scratch."""
        d = self.config.head_dim
        inv_freq = 1.0 / self.config.rope_theta ** (torch.arange(0, d, 2).float() / d)
        angles = positions.float()[:, None] * inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        half = d // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * angles.cos() + rotated * angles.sin()

    def _attention(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        cfg = self.config
        t = x.shape[0]
        positions = torch.arange(t)
        q = (x @ self.w[prefix + "q_proj.weight"].T).view(t, cfg.num_heads, -1).transpose(0, 1)
        k = (x @ self.w[prefix + "k_proj.weight"].T).view(t, cfg.num_kv_heads, -1).transpose(0, 1)
        v = (x @ self.w[prefix + "v_proj.weight"].T).view(t, cfg.num_kv_heads, -1).transpose(0, 1)
        q, k = self._rotate(q, positions), self._rotate(k, positions)
        group = cfg.num_heads // cfg.num_kv_heads
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
        scores = (q @ k.transpose(1, 2)) / cfg.head_dim ** 0.5
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v  # [H, T, D]
        return out.transpose(0, 1).reshape(t, -1) @ self.w[prefix + "o_proj.weight"].T

    def _mlp(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        gate = x @ self.w[prefix + "gate_proj.weight"].T
        up = x @ self.w[prefix + "up_proj.weight"].T
        return (gate * torch.sigmoid(gate) * up) @ self.w[prefix + "down_proj.weight"].T

    @torch.inference_mode()
    def hidden(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] for a whole sequence."""
        if not token_ids:
            raise ValueError("token_ids must not be empty")
        h = self.w["model.embed_tokens.weight"][torch.tensor(list(token_ids))]
        for i in range(self.config.num_layers):
            p = f"model.layers.{i}."
            h = h + self._attention(self._norm(h, p + "input_layernorm.weight"), p + "self_attn.")
            h = h + self._mlp(self._norm(h, p + "post_attention_layernorm.weight"), p + "mlp.")
        return self._norm(h, "model.norm.weight")

    def logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Float32 logits [T, vocab] for every position."""
        return self.hidden(token_ids) @ self.lm_head.T

    def next_token_logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        return self.hidden(token_ids)[-1] @ self.lm_head.T

    def greedy_generate(
        self,
        token_ids: Sequence[int],
        max_new_tokens: int,
        stop_token_ids: Sequence[int] = (),
    ) -> list[int]:
        """Greedy continuation (the stop token, if hit, is included and ends it)."""
        ids = list(token_ids)
        out: list[int] = []
        for _ in range(max_new_tokens):
            token = int(self.next_token_logits(ids).argmax())
            out.append(token)
            ids.append(token)
            if token in stop_token_ids:
                break
        return out
