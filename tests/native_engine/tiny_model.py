"""Tiny random-weight models for mechanics tests (real tokenizer, real chat template)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tokenizers import Tokenizer, pre_tokenizers

from native_engine.model.chat_template import ChatTemplate
from native_engine.model.llama import LlamaConfig, hf_weight_shapes
from native_engine.model.loaded import LoadedModel
from native_engine.model.tokenizer import TOKEN_TYPE_CONTROL, TextTokenizer, build_bpe_tokenizer

# SmolLM2's ChatML template, used by the random test model.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_tokenizer(special_tokens: Sequence[str]) -> Tokenizer:
    """A tiny real tokenizer: the special tokens, then the 256 byte symbols, no merges."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_symbols = sorted(alphabet, key=lambda s: (len(s), s))
    tokens = [*special_tokens, *byte_symbols]
    types = [TOKEN_TYPE_CONTROL] * len(special_tokens) + [1] * len(byte_symbols)
    return build_bpe_tokenizer(tokens, types, [], "gpt2")



def tiny_config(**overrides: object) -> LlamaConfig:
    """A small Llama shape (GQA 4/2 heads) for fast mechanics tests."""
    fields: dict[str, object] = dict(
        vocab_size=259, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
        max_position_embeddings=512, tie_word_embeddings=True,
    )
    fields.update(overrides)
    return LlamaConfig(**fields)  # type: ignore[arg-type]


def random_model(config: LlamaConfig | None = None, seed: int = 0) -> LoadedModel:
    """Random weights with a real byte-level tokenizer (3 ChatML specials + 256 bytes)."""
    config = config or tiny_config()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    if config.vocab_size != len(specials) + 256:
        raise ValueError("the random model's byte tokenizer needs vocab_size 259")
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in hf_weight_shapes(config).items():
        if name.endswith("norm.weight"):
            weights[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            weights[name] = torch.randn(shape, generator=gen) / shape[-1] ** 0.5
    tokenizer = TextTokenizer(byte_tokenizer(specials), "<|im_start|>", "<|im_end|>")
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer,
                       chat_template=ChatTemplate(CHATML_TEMPLATE, "<|im_start|>", "<|im_end|>"),
                       source="random")
