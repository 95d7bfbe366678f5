"""`fak generate`: one completion from the native engine, printed to stdout."""

from __future__ import annotations

import sys

from native_engine.config import EngineConfig
from native_engine.engine import LLMEngine
from native_engine.request import SamplingParams


def cmd_generate(prompt: str, chat: bool, max_tokens: int, temperature: float,
                 seed: int | None, model: str | None, attention_backend: str,
                 device: str) -> int:
    engine = LLMEngine.from_config(EngineConfig(
        num_blocks=256, model=model, attention_backend=attention_backend, device=device))
    text = prompt
    if chat:
        template = engine.model_runner.chat_template
        if template is None:
            print("fak: this model has no chat template; drop --chat", file=sys.stderr)
            return 2
        text = template.render([{"role": "user", "content": prompt}])
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                            stop_token_ids=engine.model_runner.stop_token_ids)
    (result,) = engine.generate([text], params)
    print(result.text)
    return 0
