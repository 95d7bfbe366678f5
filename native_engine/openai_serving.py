"""Serve one OpenAI request on the native engine: body in, vLLM-shaped dicts out.

Used by the in-process driver (adapters/native.py) and by `fak engine serve`, so both give
the same answers. Errors are raised as EngineError with vLLM's status, type and param.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from native_engine.async_engine import AsyncLLMEngine, EngineDeadError
from native_engine.chat_template import ChatTemplate, ChatTemplateError
from native_engine.openai_api import (
    Completion,
    bad_request,
    full_response,
    response_id,
    sampling_params,
    stream_chunk,
    usage_chunk,
)
from native_engine.request import SamplingParams
from native_engine.tokenizer import TextTokenizer
from schemas.engine import EngineError


@dataclass(frozen=True, slots=True)
class ServingConfig:
    model_name: str
    max_model_len: int
    prompt_tokens_details: bool = True
    priority_enabled: bool = True


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, tokenizer: TextTokenizer,
                 chat_template: ChatTemplate | None, config: ServingConfig) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.config = config

    def prompt_ids(self, route: str, body: dict[str, Any]) -> list[int]:
        if route == "chat":
            if self.chat_template is None:
                raise bad_request("this model has no chat template", "messages")
            try:
                text = self.chat_template.render(body["messages"], add_generation_prompt=True)
            except ChatTemplateError as exc:
                raise bad_request(str(exc), "messages") from None
            return self.tokenizer.encode(text)
        prompt = body.get("prompt")
        if isinstance(prompt, str) and prompt:
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and 0 <= t < self.tokenizer.vocab_size for t in prompt):
            return list(prompt)
        raise bad_request("'prompt' must be a non-empty string or a list of token ids",
                          "prompt")

    def params(self, route: str, body: dict[str, Any], prompt_len: int) -> SamplingParams:
        return sampling_params(route, body, prompt_len, self.config.max_model_len,
                               self.tokenizer.stop_token_ids, self.config.priority_enabled)

    async def run(self, route: str, body: dict[str, Any], request_id: str
                  ) -> AsyncIterator[dict[str, Any] | None]:
        """Yield response dicts: one full response, or stream chunks then None for [DONE]."""
        ids = self.prompt_ids(route, body)
        params = self.params(route, body, len(ids))
        rid = response_id(route, request_id)
        model, created = self.config.model_name, int(time.time())
        stream = bool(body.get("stream"))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        text: list[str] = []
        first = True
        try:
            async for out in self.engine.generate(ids, params, request_id):
                if stream and (out.text_delta or out.finished):
                    yield stream_chunk(route, rid, model, created, out.text_delta,
                                       out.finish_reason, first)
                    first = False
                text.append(out.text_delta)
                last = out
        except EngineDeadError as exc:
            raise EngineError(503, f"the native engine is not running: {exc}",
                              type="ServiceUnavailableError") from None
        except ValueError as exc:
            raise bad_request(str(exc), None) from None
        done = Completion("".join(text), last.finish_reason, last.num_prompt_tokens,
                          last.num_output_tokens, last.cached_tokens)
        if not stream:
            yield full_response(route, rid, model, done, self.config.prompt_tokens_details,
                                created)
            return
        if include_usage:
            yield usage_chunk(route, rid, model, created, done,
                              self.config.prompt_tokens_details)
        yield None

    def models(self, root: str) -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": self.config.model_name, "object": "model", "created": int(time.time()),
            "owned_by": "fak", "root": root, "parent": None,
            "max_model_len": self.config.max_model_len, "permission": [],
        }]}
