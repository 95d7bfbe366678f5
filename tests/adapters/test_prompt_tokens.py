"""The router's prompt tokens: the same ids with the token-prefix cache as without, for
chat and text prompts, and the same block-hash chains, only the new blocks hashed; the
cache is sized by `[engine.routing] tokenize_cache_entries` (0: off)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading

from adapters.prompt_tokens import CHAINS_PER_TEXT, PromptTokens
from adapters.vllm.shadow_index import prompt_chain
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
            got, want = cached.of(r), whole.of(r)
            assert got is not None and want is not None and got.ids == want.ids
    assert cached.cache.stats.hits >= 20
    cached.cache.check_integrity()


def test_the_cache_size_is_configured() -> None:
    assert RoutingSection().tokenize_cache_entries == 1024
    assert PromptTokens.load("embedded", 0).cache is None
    assert PromptTokens.load(None, 1024).cache is None  # no tokenizer: token ids only


def test_chains_equal_whole_chains_and_reuse_the_shared_blocks() -> None:
    """A tenant's next turn shares the conversation so far: its chain is the whole prompt's,
    and the keys of the blocks shared with the last turn are that turn's (not re-hashed).
    Another namespace, block size or tenant starts over; a text seen again reuses all."""
    rng = random.Random(9)
    tokens = PromptTokens.load("embedded", 64)
    words = ["alpha", "beta", "12", "it's", "\n", "gamma", "!"]
    conversation = " ".join(rng.choice(words) for _ in range(300))
    last = None
    for turn in range(6):
        conversation += " " + " ".join(rng.choice(words) for _ in range(40 + turn))
        prompt = tokens.of(request("completions", {"prompt": conversation}))
        assert prompt is not None and prompt.prefixed is not None
        chain = prompt.chain("ns-a", 16)
        assert chain == prompt_chain("ns-a", prompt.ids, 16)
        shared = prompt.prefixed.reused // 16
        if last is not None:
            assert shared >= len(last) - 1 and all(
                a is b for a, b in zip(chain[:shared], last, strict=False))
        assert prompt.chain("ns-b", 32) == prompt_chain("ns-b", prompt.ids, 32)
        last = chain
    again = tokens.of(request("completions", {"prompt": conversation}))
    assert again is not None and again.chain("ns-a", 16) is last
    other = tokens.of(EngineRequest("r", "completions", parse_request(
        "completions", {"model": "m", "prompt": conversation}), "other-tenant", "s"))  # type: ignore[arg-type]
    assert other is not None and other.prefixed is not None
    assert other.prefixed.base_memo is None  # texts are never shared across tenants
    for size in range(1, CHAINS_PER_TEXT + 3):  # a text keeps a few chains at most
        again.chain("ns-a", size)
    assert len(again.prefixed.memo) == CHAINS_PER_TEXT  # type: ignore[union-attr]


async def test_a_long_prompt_is_tokenised_off_the_loop_with_the_cache() -> None:
    """A 360 KiB prompt: the same ids as `of` gives, tokenised on a thread while the loop
    keeps running; the cache goes with it (the next turn reuses it), and a prompt arriving
    meanwhile is tokenised without it. Cancelling the caller does not return the cache
    before the thread is done with it."""
    tokens, whole = PromptTokens.load("embedded", 1024), PromptTokens.load("embedded")
    assert tokens.cache is not None
    long = request("completions", {"prompt": "ab " * 120_000})
    short = request("completions", {"prompt": "a short one"})
    assert tokens.is_long(long) and not tokens.is_long(short)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.001)
            ticks += 1

    ticking = asyncio.create_task(ticker())
    work = asyncio.create_task(tokens.of_off_loop(long, [("ns-a", 16), ("ns-b", 32)]))
    await asyncio.sleep(0.01)
    assert tokens.cache_lent
    misses = tokens.cache.stats.misses
    meanwhile = tokens.of(short)
    assert meanwhile is not None and meanwhile.prefixed is None
    assert tokens.cache.stats.misses == misses
    ticks_before = ticks
    got = await work
    assert ticks - ticks_before >= 20 and not tokens.cache_lent
    want = whole.of(long)
    assert got is not None and want is not None and got.ids == want.ids
    assert got.prefixed is not None and len(tokens.cache) == 1
    assert got.chains == {key: prompt_chain(key[0], want.ids, key[1])  # hashed there too
                          for key in (("ns-a", 16), ("ns-b", 32))}

    turn = request("completions", {"prompt": "ab " * 120_000 + "cd"})
    cancelled = asyncio.create_task(tokens.of_off_loop(turn))
    await asyncio.sleep(0.01)
    cancelled.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await cancelled
    assert tokens.cache_lent  # the thread still has it
    while tokens.cache_lent:
        await asyncio.sleep(0.01)
    assert tokens.cache.stats.hits == 1 and len(tokens.cache) == 2
    tokens.cache.check_integrity()
    ticking.cancel()


async def test_a_long_token_id_prompt_is_hashed_off_the_loop(
        chain_threads: list[threading.Thread]) -> None:
    """Without a tokenizer too: 400 Ki token ids are checked and their chain hashed on a
    worker thread; a short one stays on the loop."""
    hashed_on = chain_threads
    for tokens in (PromptTokens.load(None), PromptTokens.load("embedded", 64)):
        ids = [i % 49152 for i in range(400_000)]
        long, short = request("completions", {"prompt": ids}), request(
            "completions", {"prompt": ids[:100]})
        assert tokens.is_long(long) and not tokens.is_long(short)
        got = await tokens.of_off_loop(long, [("ns", 16)])
        assert got is not None and got.ids == ids
        assert got.chains[("ns", 16)] == prompt_chain("ns", ids, 16)
        assert hashed_on and threading.main_thread() not in hashed_on
        hashed_on.clear()
        assert tokens.of(short).ids == ids[:100]  # type: ignore[union-attr]
        assert not hashed_on  # on the loop, the chain only when asked
