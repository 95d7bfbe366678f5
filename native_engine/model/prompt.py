"""A request's prompt as token ids: chat messages through the model's chat template (with
the generation prompt), a text prompt through the tokenizer, token ids as given — the one
place both the native server and the governor's router turn a typed body into tokens."""

from __future__ import annotations

from collections.abc import Callable

from native_engine.model.chat_template import ChatTemplate, ChatTemplateError
from native_engine.model.tokenizer import TextTokenizer
from schemas.openai import AnyRequest, ChatRequest


class PromptInvalid(ValueError):
    """The body's prompt cannot be tokenised; `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def prompt_token_ids(parsed: AnyRequest, tokenizer: TextTokenizer,
                     template: ChatTemplate | None,
                     encode: Callable[[str], list[int]] | None = None) -> list[int]:
    """`encode` (default: the tokenizer's) turns text into ids; the router passes its
    token-prefix cache."""
    encode = encode or tokenizer.encode
    if isinstance(parsed, ChatRequest):
        if template is None:
            raise PromptInvalid("this model has no chat template", "messages")
        messages = [{**m.model_dump(exclude_none=True), "content": m.text()}
                    for m in parsed.messages]
        try:
            text = template.render(messages, add_generation_prompt=True)
        except ChatTemplateError as exc:
            raise PromptInvalid(str(exc), "messages") from None
        return encode(text)
    prompt = parsed.prompt
    if isinstance(prompt, str) and prompt:
        return encode(prompt)
    if isinstance(prompt, list) and prompt:
        ids = [t for t in prompt if isinstance(t, int) and 0 <= t < tokenizer.vocab_size]
        if len(ids) == len(prompt):
            return ids
    raise PromptInvalid("'prompt' must be a non-empty string or a list of token ids (one "
                        "prompt per request on the native engine)", "prompt")
