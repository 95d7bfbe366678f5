"""The router's prompt tokens: the same ids with the token-prefix cache as without, for
chat and text prompts; the cache is sized by `[engine.routing] tokenize_cache_entries`
(0: off)."""

from __future__ import annotations

import random

from adapters.prompt_tokens import PromptTokens
from governor.config import RoutingSection
from schemas.engine import EngineRequest
from schemas.openai import parse_request


def request(route: str, body: dict) -> EngineRequest:
    return EngineRequest("r", route, parse_request(route, {"model": "m", **body}), "t", "s")  # type: ignore[arg-type]


def test_cached_ids_equal_whole_ids_for_chat_and_text() -> None:
    rng = random.Random(5)
    system = " ".join(rng.choice(["alpha", "beta", "12", "it's", "\n"]) for _ in range(200))
    whole, cached = PromptTokens.load("embedded"), PromptTokens.load("embedded", 64)
    assert whole.cache is None and cached.cache is not None
    for turn in range(12):
        suffix = " ".join(rng.choice(["gamma", "7", "!", "  "]) for _ in range(turn + 3))
        for r in (request("completions", {"prompt": system + suffix}),
                  request("chat", {"messages": [{"role": "system", "content": system},
                                                {"role": "user", "content": suffix}]})):
            assert cached.of(r) == whole.of(r)
    assert cached.cache.stats.hits >= 20
    cached.cache.check_integrity()


def test_the_cache_size_is_configured() -> None:
    assert RoutingSection().tokenize_cache_entries == 1024
    assert PromptTokens.load("embedded", 0).cache is None
    assert PromptTokens.load(None, 1024).cache is None  # no tokenizer: token ids only
