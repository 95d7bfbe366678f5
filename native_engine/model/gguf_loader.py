"""Load a Llama-family GGUF file into HF-layout float weights, tokenizer and chat template.

Quantised tensors are dequantised with `gguf.quants.dequantize`. llama.cpp's converter
permutes the rows of q/k projections (interleaved rotary pairs); they are permuted back so
the weights are in Hugging Face layout and work with rotate-half RoPE.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from native_engine.model.chat_template import ChatTemplate
from native_engine.model.llama import LlamaConfig, check_weights
from native_engine.model.loaded import LoadedModel
from native_engine.model.tokenizer import (
    END_OF_GENERATION_TEXTS,
    TextTokenizer,
    build_bpe_tokenizer,
)

SUPPORTED_ARCHITECTURES = ("llama",)

# GGUF tensor-name stems → HF names (per layer where {i} appears).
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}

_MISSING = object()


def field(reader: gguf.GGUFReader, key: str, default: Any = _MISSING) -> Any:
    """A metadata value, or `default`; a missing required key is a clear error."""
    entry = reader.fields.get(key)
    if entry is None:
        if default is _MISSING:
            raise ValueError(f"GGUF metadata lacks {key!r}")
        return default
    return entry.contents()


def float32_value(value: Any) -> float:
    """A float32 metadata value as its shortest decimal (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation: per head, rows (pair, 2) → (2, pair)."""
    rows, *rest = weight.shape
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *rest)
            .transpose(1, 2).reshape(weight.shape))


def dequantize_tensor(tensor: gguf.ReaderTensor) -> np.ndarray:
    """Float32 array in torch layout [rows, cols] (GGUF lists dimensions innermost first)."""
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    return np.array(values, dtype=np.float32, copy=True).reshape(shape)


def read_config(reader: gguf.GGUFReader) -> LlamaConfig:
    arch = field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}")
    scaling = field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"unsupported rope scaling {scaling!r}")
    hidden = int(field(reader, f"{arch}.embedding_length"))
    heads = int(field(reader, f"{arch}.attention.head_count"))
    names = {t.name for t in reader.tensors}
    return LlamaConfig(
        vocab_size=len(field(reader, "tokenizer.ggml.tokens")),
        hidden_size=hidden,
        intermediate_size=int(field(reader, f"{arch}.feed_forward_length")),
        num_layers=int(field(reader, f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(field(reader, f"{arch}.attention.key_length", hidden // heads)),
        rope_theta=float32_value(field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float32_value(field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(field(reader, f"{arch}.context_length")),
        tie_word_embeddings="output.weight" not in names,
    )


def read_weights(reader: gguf.GGUFReader, config: LlamaConfig) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        value = torch.from_numpy(dequantize_tensor(tensor))
        if name.endswith("q_proj.weight"):
            value = unpermute_rotary_rows(value, config.num_heads)
        elif name.endswith("k_proj.weight"):
            value = unpermute_rotary_rows(value, config.num_kv_heads)
        weights[name] = value
    check_weights(config, weights)
    return weights


def pick_eos(tokens: list[str], eos_id: int | None, eot_id: int | None, template: str) -> str:
    """The token that ends an assistant turn: the declared EOT, else the declared EOS,
    else the end-of-generation token the chat template closes turns with."""
    for declared in (eot_id, eos_id):
        if declared is not None:
            return tokens[declared]
    vocab = set(tokens)
    for text in END_OF_GENERATION_TEXTS:
        if text in vocab and text in template:
            return text
    raise ValueError("GGUF declares no EOS token and none could be inferred")


def read_tokenizer(reader: gguf.GGUFReader) -> tuple[TextTokenizer, ChatTemplate | None]:
    model = field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {model!r} (byte-level BPE only)")
    tokens = list(field(reader, "tokenizer.ggml.tokens"))
    backend = build_bpe_tokenizer(
        tokens,
        list(field(reader, "tokenizer.ggml.token_type")),
        list(field(reader, "tokenizer.ggml.merges", [])),
        field(reader, "tokenizer.ggml.pre", "default"),
    )
    declared = [field(reader, f"tokenizer.ggml.{k}_token_id", None) for k in ("bos", "eos",
                                                                             "eot", "eom")]
    bos_id, eos_id, eot_id, eom_id = (None if i is None else int(i) for i in declared)
    source = field(reader, "tokenizer.chat_template", None)
    bos = None if bos_id is None else tokens[bos_id]
    eos = pick_eos(tokens, eos_id, eot_id, source or "")
    extra = [i for i in (eos_id, eot_id, eom_id) if i is not None]
    tokenizer = TextTokenizer(backend, bos, eos, extra)
    return tokenizer, None if source is None else ChatTemplate(source, bos, eos)


def load_gguf(path: Path) -> LoadedModel:
    """Everything in a GGUF file, weights as float32 in HF layout."""
    reader = gguf.GGUFReader(path)
    config = read_config(reader)
    tokenizer, template = read_tokenizer(reader)
    if tokenizer.vocab_size != config.vocab_size:
        raise ValueError("tokenizer and embedding vocabulary sizes differ")
    return LoadedModel(config=config, weights=read_weights(reader, config),
                       tokenizer=tokenizer, chat_template=template, source=str(path))
