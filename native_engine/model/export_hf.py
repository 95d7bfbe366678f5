"""Write a model as a Hugging Face Llama directory that vLLM and transformers load."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from native_engine.model.loaded import DTYPES, LoadedModel, dtype_name
from native_engine.model.weights import load_model


def hf_config(model: LoadedModel, dtype: torch.dtype) -> dict[str, Any]:
    cfg, tok = model.config, model.tokenizer
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "torch_dtype": dtype_name(dtype),
    }


def tokenizer_config(model: LoadedModel) -> dict[str, Any]:
    tok = model.tokenizer
    added = {
        str(i): {"content": t.content, "lstrip": t.lstrip, "rstrip": t.rstrip,
                 "normalized": t.normalized, "single_word": t.single_word, "special": t.special}
        for i, t in sorted(tok.backend.get_added_tokens_decoder().items())
    }
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [t["content"] for t in added.values() if t["special"]],
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "pad_token": tok.eos_token,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model.config.max_position_embeddings,
    }
    if model.chat_template is not None:
        config["chat_template"] = model.chat_template.source
    return config


def generation_config(model: LoadedModel) -> dict[str, Any]:
    tok = model.tokenizer
    return {"bos_token_id": tok.bos_token_id, "eos_token_id": list(tok.stop_token_ids)}


def export_model(model: LoadedModel, outdir: Path, dtype: torch.dtype = torch.float32) -> None:
    """Write config, weights (HF names, one file), tokenizer and chat template to `outdir`."""
    outdir.mkdir(parents=True, exist_ok=True)
    weights = {k: v.to(dtype).contiguous() for k, v in model.weights.items()}
    save_file(weights, str(outdir / "model.safetensors"), metadata={"format": "pt"})
    _write_json(outdir / "config.json", hf_config(model, dtype))
    _write_json(outdir / "generation_config.json", generation_config(model))
    _write_json(outdir / "tokenizer_config.json", tokenizer_config(model))
    (outdir / "tokenizer.json").write_text(model.tokenizer.to_json())
    if model.chat_template is not None:
        (outdir / "chat_template.jinja").write_text(model.chat_template.source)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def export_hf(outdir: str | Path, model_path: str | Path | None = None,
              dtype: str = "float32") -> Path:
    """Export the model at `model_path` (None: the embedded GGUF) to `outdir`."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}")
    target = Path(outdir)
    if target.exists() and any(target.iterdir()):
        raise FileExistsError(f"{target} exists and is not empty")
    model = load_model(model_path, torch.float32)
    export_model(model, target, DTYPES[dtype])
    return target


def cmd_export_hf(outdir: str) -> int:
    """CLI entry (`fak model export-hf OUTDIR`): 0 on success, 1 with a message on error."""
    try:
        path = export_hf(outdir)
    except (OSError, ValueError) as exc:
        print(f"export-hf: {exc}", file=sys.stderr)
        return 1
    print(f"exported HF model to {path}")
    return 0
