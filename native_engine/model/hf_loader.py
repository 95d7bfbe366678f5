"""Load a local Hugging Face Llama-family directory (config.json, *.safetensors,
tokenizer.json, tokenizer_config.json, optional chat_template.jinja / generation_config.json)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors.torch import load_file
from tokenizers import Tokenizer

from native_engine.model.chat_template import ChatTemplate
from native_engine.model.llama import LlamaConfig, check_weights
from native_engine.model.loaded import LoadedModel
from native_engine.model.tokenizer import TextTokenizer

SUPPORTED_MODEL_TYPES = ("llama",)
IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)


def _read_json(path: Path, required: bool = True) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise FileNotFoundError(f"{path} is missing")
        return {}
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return data


def config_from_hf(data: dict[str, Any]) -> LlamaConfig:
    if data.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model_type {data.get('model_type')!r}")
    if data.get("rope_scaling") is not None:
        raise ValueError(f"unsupported rope_scaling {data['rope_scaling']!r}")
    if data.get("attention_bias") or data.get("mlp_bias"):
        raise ValueError("attention/MLP biases are not supported")
    if data.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {data['hidden_act']!r}")
    heads = int(data["num_attention_heads"])
    hidden = int(data["hidden_size"])
    return LlamaConfig(
        vocab_size=int(data["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(data["intermediate_size"]),
        num_layers=int(data["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(data.get("num_key_value_heads") or heads),
        head_dim=int(data.get("head_dim") or hidden // heads),
        rope_theta=float(data.get("rope_theta", 10000.0)),
        rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(data.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
    )


def _token_text(value: Any) -> str | None:
    """HF stores special tokens either as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def _chat_template_source(directory: Path, tok_config: dict[str, Any]) -> str | None:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    source = tok_config.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source}
        source = named.get("default")
    return source


def load_hf_dir(directory: Path) -> LoadedModel:
    """Everything in an HF directory; weights keep their stored dtype."""
    hf_config = _read_json(directory / "config.json")
    config = config_from_hf(hf_config)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {directory}")
    weights = {}
    for file in files:
        weights.update(load_file(str(file)))
    weights = {k: v for k, v in weights.items() if not k.endswith(IGNORED_TENSOR_SUFFIXES)}
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    check_weights(config, weights)
    tokenizer, template = load_hf_tokenizer(directory, hf_config)
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer,
                       source=str(directory), chat_template=template)


def load_hf_tokenizer(directory: Path, hf_config: dict[str, Any] | None = None
                      ) -> tuple[TextTokenizer, ChatTemplate | None]:
    """The tokenizer and chat template of an HF directory, without its weights."""
    if hf_config is None:
        hf_config = _read_json(directory / "config.json", required=False)
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise FileNotFoundError(f"{tokenizer_file} is missing")
    tok_config = _read_json(directory / "tokenizer_config.json", required=False)
    gen_config = _read_json(directory / "generation_config.json", required=False)
    bos = _token_text(tok_config.get("bos_token"))
    eos = _token_text(tok_config.get("eos_token"))
    stops = _id_list(hf_config.get("eos_token_id")) + _id_list(gen_config.get("eos_token_id"))
    tokenizer = TextTokenizer(Tokenizer.from_file(str(tokenizer_file)), bos, eos, stops)
    source = _chat_template_source(directory, tok_config)
    return tokenizer, None if source is None else ChatTemplate(source, bos, eos)
