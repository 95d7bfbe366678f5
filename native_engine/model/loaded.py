"""`LoadedModel`: what every loader returns, and the weight dtypes the engine runs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from native_engine.model.chat_template import ChatTemplate
from native_engine.model.llama import LlamaConfig
from native_engine.model.tokenizer import TextTokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    """A model ready to build: config, HF-named weights, tokenizer, chat template."""

    config: LlamaConfig
    weights: dict[str, torch.Tensor]
    tokenizer: TextTokenizer
    chat_template: ChatTemplate | None
    source: str


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported weight dtype {dtype}")
