"""`LoadedModel`: what every loader returns, and the weight dtypes the engine runs."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from native_engine.model.chat_template import ChatTemplate
from native_engine.model.llama import LlamaConfig
from native_engine.model.tokenizer import TextTokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    """A model ready to build: config, HF-named weights, tokenizer, chat template, and the
    `digest` of the file it came from ("" when there is none: see `weights_digest`)."""

    config: LlamaConfig
    weights: dict[str, torch.Tensor]
    tokenizer: TextTokenizer
    chat_template: ChatTemplate | None
    source: str
    digest: str = ""


def weights_digest(weights: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the weights' names, dtypes, shapes and bytes (for models without a file)."""
    h = hashlib.sha256()
    for name in sorted(weights):
        t = weights[name].detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().data)
    return "weights-sha256:" + h.hexdigest()


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported weight dtype {dtype}")
