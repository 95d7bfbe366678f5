"""A request's prompt tokens as the engines will see them, for KV-aware routing.

The same rendering the native server uses (native_engine.model.prompt): chat messages
through the model's chat template with the generation prompt, text through its tokenizer,
token ids as given. vLLM tokenises the same way for a model it serves from the same
tokenizer files, which the operator names (`[engine.routing] tokenizer`). Without a
tokenizer only token-id prompts can be matched against the shadow indexes.

Texts go through a token-prefix cache (native_engine.model.token_prefix_cache) where the
tokenizer is of a kind it is exact for, so a system prompt many requests share is
tokenised once: the routing decision's cost is then mostly the new suffix. Each tenant
has its own texts there (a shared cache would time other tenants' prompts).
"""

from __future__ import annotations

from functools import partial

from native_engine.model.chat_template import ChatTemplate
from native_engine.model.prompt import PromptInvalid, prompt_token_ids
from native_engine.model.token_prefix_cache import TokenPrefixCache
from native_engine.model.tokenizer import TextTokenizer
from schemas.engine import EngineRequest
from schemas.openai import ChatRequest

EMBEDDED = "embedded"
# The token-prefix cache's budget per entry, on average: 1,024 entries hold at most 512 Ki
# token ids (45 MiB of RSS measured), however long the prompts clients send.
TOKENS_PER_ENTRY = 512


class PromptTokens:
    """Token ids of a request's prompt, or None when they cannot be known here."""

    def __init__(self, tokenizer: TextTokenizer | None = None,
                 template: ChatTemplate | None = None, cache_entries: int = 0) -> None:
        self.tokenizer, self.template = tokenizer, template
        self.cache = TokenPrefixCache(tokenizer.backend, cache_entries,
                                      max_tokens=cache_entries * TOKENS_PER_ENTRY) if (
            tokenizer is not None and cache_entries > 0
            and TokenPrefixCache.supports(tokenizer.backend)) else None

    @classmethod
    def load(cls, source: str | None, cache_entries: int = 0) -> PromptTokens:
        """`"embedded"` (the embedded SmolLM2), a `.gguf` file or an HF directory; None:
        no tokenizer (token-id prompts only). `cache_entries`: the token-prefix cache's
        size (0: off; also off for a tokenizer it is not exact for)."""
        if source is None:
            return cls()
        from native_engine.model.weights import load_tokenizer

        return cls(*load_tokenizer(None if source == EMBEDDED else source), cache_entries)

    def of(self, request: EngineRequest) -> list[int] | None:
        body = request.body
        if self.tokenizer is None:
            prompt = None if isinstance(body, ChatRequest) else body.prompt
            ids = [t for t in prompt or () if isinstance(t, int) and not isinstance(t, bool)
                   and t >= 0] if isinstance(prompt, list) else []
            return ids if ids and len(ids) == len(prompt or ()) else None
        try:
            encode = None if self.cache is None else partial(self.cache.encode,
                                                             namespace=request.tenant)
            return prompt_token_ids(body, self.tokenizer, self.template, encode)
        except PromptInvalid:
            return None  # the engine will answer the 400
