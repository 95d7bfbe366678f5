"""A request's prompt as token ids: chat messages through the model's chat template (with
the generation prompt), a text prompt through the tokenizer, token ids as given — the one
place both the native server and the governor's router turn a typed body into tokens."""

from __future__ import annotations

from collections.abc import Callable

from native_engine.model.chat_template import ChatTemplate, ChatTemplateError
from native_engine.model.tokenizer import TextTokenizer
from schemas.openai import AnyRequest, ChatRequest

# Prompts this long are tokenised on a worker thread (the native server, the router): ~11 ms
# of tokenising at 32 Ki characters, 0.6 s at 800 Ki.
OFF_LOOP_CHARS = 32 << 10
# Token-id prompts this long too: checking 400 Ki ids took 41 ms, hashing their chain for
# the router 18-39 ms.
OFF_LOOP_IDS = 8192
# Chats of this many messages too, however short: each costs ~6 us to dump and render
# through the template, so 3,580 messages of "hi" held the loop ~60 ms.
OFF_LOOP_MESSAGES = 256


def off_loop(parsed: AnyRequest) -> bool:
    """Whether turning this body into token ids is worth a worker thread."""
    if isinstance(parsed, ChatRequest) and len(parsed.messages) >= OFF_LOOP_MESSAGES:
        return True
    return text_size(parsed) >= OFF_LOOP_CHARS or id_count(parsed) >= OFF_LOOP_IDS


def id_count(parsed: AnyRequest) -> int:
    """Items of a list prompt (token ids as given); 0 for a text or chat."""
    if isinstance(parsed, ChatRequest) or not isinstance(parsed.prompt, list):
        return 0
    return len(parsed.prompt)


def text_size(parsed: AnyRequest) -> int:
    """Characters the tokenizer and chat template will see."""
    if isinstance(parsed, ChatRequest):
        return sum(len(m.text() or "") for m in parsed.messages)
    prompt = parsed.prompt
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(p) for p in prompt or () if isinstance(p, str))


class PromptInvalid(ValueError):
    """The body's prompt cannot be tokenised; `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def prompt_text(parsed: AnyRequest, template: ChatTemplate | None) -> str | None:
    """The text a request's prompt is tokenised from: a chat's messages through the chat
    template with the generation prompt, a completion's string; None for anything else
    (token ids, or what `prompt_token_ids` refuses)."""
    if isinstance(parsed, ChatRequest):
        if template is None:
            raise PromptInvalid("this model has no chat template", "messages")
        messages = [{**m.model_dump(exclude_none=True), "content": m.text()}
                    for m in parsed.messages]
        try:
            return template.render(messages, add_generation_prompt=True)
        except ChatTemplateError as exc:
            raise PromptInvalid(str(exc), "messages") from None
    prompt = parsed.prompt
    return prompt if isinstance(prompt, str) and prompt else None


def prompt_token_ids(parsed: AnyRequest, tokenizer: TextTokenizer,
                     template: ChatTemplate | None,
                     encode: Callable[[str], list[int]] | None = None) -> list[int]:
    """`encode` (default: the tokenizer's) turns text into ids; the router passes its
    token-prefix cache."""
    text = prompt_text(parsed, template)
    if text is not None:
        return (encode or tokenizer.encode)(text)
    assert not isinstance(parsed, ChatRequest)
    prompt = parsed.prompt
    if isinstance(prompt, list) and prompt:
        vocab = tokenizer.vocab_size  # once: 0.7 µs a call, 330 ms over 400 Ki ids
        ids = [t for t in prompt if isinstance(t, int) and 0 <= t < vocab]
        if len(ids) == len(prompt):
            return ids
    raise PromptInvalid("'prompt' must be a non-empty string or a list of token ids (one "
                        "prompt per request on the native engine)", "prompt")
