"""A request's prompt tokens as the engines will see them, for KV-aware routing.

The same rendering the native server uses (native_engine.model.prompt): chat messages
through the model's chat template with the generation prompt, text through its tokenizer,
token ids as given. vLLM tokenises the same way for a model it serves from the same
tokenizer files, which the operator names (`[engine.routing] tokenizer`). Without a
tokenizer only token-id prompts can be matched against the shadow indexes.

Texts go through a token-prefix cache (native_engine.model.token_prefix_cache) where the
tokenizer is of a kind it is exact for, so a system prompt many requests share is
tokenised once: the routing decision's cost is then mostly the new suffix. Each tenant
has its own texts there (a shared cache would time other tenants' prompts). The chain keys
of a text's full blocks are kept in its memo there (`PromptIds.chain`), so the blocks a
prompt shares with an earlier text of the tenant are not hashed again either: a decision
costs what the new tokens cost, however long the shared part (a long conversation's next
turn, a long system prompt).

A long prompt (`OFF_LOOP_CHARS` of text, `OFF_LOOP_IDS` token ids) is tokenised or
checked on a worker thread (`of_off_loop`): 0.6 s of tokenising an 800 KiB prompt on the
event loop stalled every stream the governor relays. The cache goes to that thread with
it, one owner at a time (the cache is not thread-safe): prompts arriving meanwhile are
tokenised without it, and a second long one on a thread of its own. Its block-hash chains
are hashed there too (18-39 ms a chain at 400 Ki tokens).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field

from adapters.vllm.shadow_index import prompt_chain
from native_engine.model.chat_template import ChatTemplate
from native_engine.model.prompt import (
    OFF_LOOP_IDS,
    PromptInvalid,
    id_count,
    off_loop,
    prompt_text,
    prompt_token_ids,
)
from native_engine.model.token_prefix_cache import PrefixedIds, PrefixLookup, TokenPrefixCache
from native_engine.model.tokenizer import TextTokenizer
from schemas.engine import EngineRequest
from schemas.openai import ChatRequest

EMBEDDED = "embedded"
# The token-prefix cache's budget per entry, on average: 1,024 entries hold at most 512 Ki
# token ids (45 MiB of RSS measured), however long the prompts clients send.
TOKENS_PER_ENTRY = 512
# Chains kept per text (one per namespace digest and block size the fleet matches in: a
# salt rotation's old and new digest, or two block sizes). A chain of 16-token blocks
# measured 4.3 bytes per token: two add ~4 MiB to the budget's 45.
CHAINS_PER_TEXT = 2


ChainKey = tuple[str | None, int]  # (namespace digest, block size)


@dataclass(frozen=True, slots=True)
class PromptIds:
    """A prompt's token ids; `prefixed`: what the token-prefix cache knew of them;
    `chains`: this request's chains so far."""

    ids: list[int]
    prefixed: PrefixedIds | None = None
    chains: dict[ChainKey, list[bytes]] = field(default_factory=dict)

    def chain(self, namespace: str | None, block_size: int) -> list[bytes]:
        """`prompt_chain` of the ids (do not mutate it: it is kept for the next prompts),
        hashing only the blocks past those an earlier text of the tenant shared."""
        key = (namespace, block_size)
        chain = self.chains.get(key)
        if chain is None:
            chain = self.chains[key] = self._chain(key)
        return chain

    def _chain(self, key: ChainKey) -> list[bytes]:
        known, (namespace, block_size) = self.prefixed, key
        if known is None:
            return prompt_chain(namespace, self.ids, block_size)
        chain: list[bytes] | None = known.memo.get(key)
        if chain is None:
            head = (known.base_memo or {}).get(key, ())[:known.reused // block_size]
            chain = prompt_chain(namespace, self.ids, block_size, head)
            if len(known.memo) >= CHAINS_PER_TEXT:
                del known.memo[next(iter(known.memo))]
            known.memo[key] = chain
        return chain


@dataclass(frozen=True, slots=True)
class PromptDraft:
    """A text prompt's ids before its new part is tokenised: `known` of them are known
    (`lookup.ids`), and at most `more_at_most` follow (0: they are all known).
    `PromptTokens.finish` gives them all; `chains`: the known ids' chains so far."""

    request: EngineRequest
    lookup: PrefixLookup
    chains: dict[ChainKey, list[bytes]] = field(default_factory=dict)

    @property
    def known(self) -> int:
        return self.lookup.count

    @property
    def more_at_most(self) -> int:
        return self.lookup.tokens_after_at_most()

    def chain(self, namespace: str | None, block_size: int) -> list[bytes]:
        """`prompt_chain` of the known ids' full blocks (the earlier text's keys reused;
        do not mutate it)."""
        key = (namespace, block_size)
        chain = self.chains.get(key)
        if chain is None:
            full = self.lookup.count // block_size
            head = (self.lookup.base_memo or {}).get(key, ())[:full]
            chain = self.chains[key] = head if len(head) == full else prompt_chain(
                namespace, self.lookup.ids, block_size, head)
        return chain


class PromptTokens:
    """Token ids of a request's prompt, or None when they cannot be known here."""

    def __init__(self, tokenizer: TextTokenizer | None = None,
                 template: ChatTemplate | None = None, cache_entries: int = 0) -> None:
        self.tokenizer, self.template = tokenizer, template
        self.cache = TokenPrefixCache(tokenizer.backend, cache_entries,
                                      max_tokens=cache_entries * TOKENS_PER_ENTRY) if (
            tokenizer is not None and cache_entries > 0
            and TokenPrefixCache.supports(tokenizer.backend)) else None
        self.cache_lent = False  # on a worker thread, tokenising a long prompt

    @classmethod
    def load(cls, source: str | None, cache_entries: int = 0) -> PromptTokens:
        """`"embedded"` (the embedded SmolLM2), a `.gguf` file or an HF directory; None:
        no tokenizer (token-id prompts only). `cache_entries`: the token-prefix cache's
        size (0: off; also off for a tokenizer it is not exact for)."""
        if source is None:
            return cls()
        from native_engine.model.weights import load_tokenizer

        return cls(*load_tokenizer(None if source == EMBEDDED else source), cache_entries)

    def of(self, request: EngineRequest) -> PromptIds | None:
        return self._of(request, None if self.cache_lent else self.cache)

    def draft(self, request: EngineRequest) -> PromptDraft | None:
        """The leading ids the token-prefix cache knows of a text prompt (a shared system
        prompt's), before anything is tokenised; None where there is no cache to ask or
        the prompt is not text."""
        if self.cache is None or self.cache_lent:
            return None
        try:
            text = prompt_text(request.body, self.template)
        except PromptInvalid:
            return None
        if text is None:
            return None
        return PromptDraft(request, self.cache.lookup(text, request.tenant))

    def finish(self, draft: PromptDraft) -> PromptIds | None:
        """All the ids of a drafted prompt: its new part tokenised (through the cache unless
        a long prompt has it on a thread meanwhile)."""
        if self.cache is None or self.cache_lent:
            return self._of(draft.request, None)
        prefixed = self.cache.complete(draft.lookup)
        return PromptIds(prefixed.ids, prefixed)

    def is_long(self, request: EngineRequest) -> bool:
        """Whether `of_off_loop` would take this request's prompt to a thread: a text the
        tokenizer would spend milliseconds on, or token ids whose chain would."""
        if self.tokenizer is None:  # no text is tokenised here
            return id_count(request.body) >= OFF_LOOP_IDS
        return off_loop(request.body)

    async def of_off_loop(self, request: EngineRequest,
                          chains: Iterable[ChainKey] = ()) -> PromptIds | None:
        """`of` on a worker thread (for a prompt `is_long` names), with the cache unless
        another long prompt has it, and the `chains` the caller will ask for hashed there
        too (400 Ki tokens: 18-39 ms a chain). The cache comes back when the thread is done,
        even if the caller was cancelled before (the thread cannot be)."""
        if self.cache is None or self.cache_lent:
            return await asyncio.to_thread(self._of_chained, request, None, list(chains))
        self.cache_lent = True
        work = asyncio.ensure_future(asyncio.to_thread(self._of_chained, request, self.cache,
                                                       list(chains)))
        work.add_done_callback(self._returned)
        return await asyncio.shield(work)

    def _of_chained(self, request: EngineRequest, cache: TokenPrefixCache | None,
                    chains: list[ChainKey]) -> PromptIds | None:
        ids = self._of(request, cache)
        if ids is not None:
            for key in chains:
                ids.chain(*key)
        return ids

    def _returned(self, work: asyncio.Future[PromptIds | None]) -> None:
        self.cache_lent = False
        if not work.cancelled():
            work.exception()  # retrieved: a caller cancelled meanwhile never reads it

    def _of(self, request: EngineRequest, cache: TokenPrefixCache | None) -> PromptIds | None:
        body = request.body
        if self.tokenizer is None:
            prompt = None if isinstance(body, ChatRequest) else body.prompt
            ids = [t for t in prompt or () if isinstance(t, int) and not isinstance(t, bool)
                   and t >= 0] if isinstance(prompt, list) else []
            return PromptIds(ids) if ids and len(ids) == len(prompt or ()) else None
        prefixed: list[PrefixedIds] = []

        def encode(text: str) -> list[int]:
            assert cache is not None
            prefixed.append(cache.encode_prefixed(text, request.tenant))
            return prefixed[-1].ids

        try:
            ids = prompt_token_ids(body, self.tokenizer, self.template,
                                   None if cache is None else encode)
        except PromptInvalid:
            return None  # the engine will answer the 400
        return PromptIds(ids, prefixed[0] if prefixed and prefixed[0].ids is ids else None)
