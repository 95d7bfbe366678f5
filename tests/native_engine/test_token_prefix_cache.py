"""The token-prefix cache gives exactly the ids of a full encode, on the embedded SmolLM2
tokenizer, for texts that share prefixes in every way the pre-tokenizer can be fooled:
whitespace runs cut in two, digits, contractions, special-token texts cut in half."""

from __future__ import annotations

import functools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, pre_tokenizers

from native_engine.model.token_prefix_cache import TokenPrefixCache
from native_engine.model.weights import load_tokenizer

PIECES = ["a", "b", "hello", "Hello", " ", "  ", "\n", "\n\n", "\t", "'s", "'t", "'re",
          "'", "1", "23", "456", ".", ",", "!?", "é", "中文", "🙂", "<|im_start|>",
          "<|im_end|>", "<|im_", "start|>", "<|endoftext|>", "user", "assistant", "  x"]


@functools.cache
def embedded() -> Tokenizer:
    return load_tokenizer(None)[0].backend


@pytest.fixture
def tokenizer() -> Tokenizer:
    return embedded()


def full(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


texts = st.lists(st.sampled_from(PIECES), min_size=0, max_size=40).map("".join)


@settings(max_examples=400, deadline=None)
@given(base=texts, tails=st.lists(st.tuples(st.integers(0, 400), texts), min_size=1,
                                  max_size=6))
def test_encode_equals_a_full_encode(base: str, tails: list[tuple[int, str]]) -> None:
    tokenizer = embedded()
    cache = TokenPrefixCache(tokenizer, capacity=4, stride=4)
    assert cache.encode(base) == full(tokenizer, base)
    for cut, tail in tails:
        text = base[:cut] + tail
        assert cache.encode(text) == full(tokenizer, text), text
        base = text if len(text) > len(base) else base
    cache.check_integrity()


@settings(max_examples=200, deadline=None)
@given(base=texts, tails=st.lists(st.tuples(st.integers(0, 400), texts), min_size=1,
                                  max_size=6))
def test_reused_ids_are_the_base_texts_and_memos_follow_texts(
        base: str, tails: list[tuple[int, str]]) -> None:
    """`encode_prefixed`: the first `reused` ids are those of the text whose memo is
    `base_memo`; a text seen again gives its own memo back."""
    cache = TokenPrefixCache(embedded(), capacity=4, stride=4)
    ids_of: dict[int, list[int]] = {}  # memo id -> that text's ids
    memos = []  # keeps every memo alive, so no id is reused
    for text in [base, *(base[:cut] + tail for cut, tail in tails), base]:
        got = cache.encode_prefixed(text)
        assert got.ids == full(embedded(), text)
        if got.base_memo is None:
            assert got.reused == 0
        else:
            assert got.ids[:got.reused] == ids_of[id(got.base_memo)][:got.reused]
        if got.memo is got.base_memo:
            assert got.reused == len(got.ids) and ids_of[id(got.memo)] == got.ids
        memos.append(got.memo)
        ids_of.setdefault(id(got.memo), got.ids)
    cache.check_integrity()


@settings(max_examples=200, deadline=None)
@given(base=texts, tails=st.lists(st.tuples(st.integers(0, 400), texts), min_size=1,
                                  max_size=6), capacity=st.integers(1, 4))
def test_lookups_completed_later_and_out_of_order_give_full_encodes(
        base: str, tails: list[tuple[int, str]], capacity: int) -> None:
    """`lookup` then `complete`, other texts looked up, completed (and evicted) between
    the two: the known ids lead the full encode, the rest follow, at most one per UTF-8
    byte of the text after the known ids' end."""
    tokenizer = embedded()
    cache = TokenPrefixCache(tokenizer, capacity=capacity, stride=4)
    cache.encode(base)
    found = [cache.lookup(base[:cut] + tail) for cut, tail in tails]
    for lookup in reversed(found):
        ids = full(tokenizer, lookup.text)
        assert ids[:len(lookup.ids)] == lookup.ids
        assert len(ids) - len(lookup.ids) <= lookup.tokens_after_at_most()
        assert cache.complete(lookup).ids == ids
        cache.check_integrity()


def test_a_shared_system_prompt_is_tokenised_once(tokenizer: Tokenizer) -> None:
    rng = random.Random(7)

    def letters(n: int) -> str:
        return " ".join(rng.choice("abcdefghij") for _ in range(n))

    system = letters(256)
    cache = TokenPrefixCache(tokenizer)
    for _ in range(20):
        text = system + " " + letters(24)
        assert cache.encode(text) == full(tokenizer, text)
    assert cache.stats.misses == 1 and cache.stats.hits == 19
    # each hit encoded at most the suffix (and the space before it) and the safety margin:
    # the characters shared past the last checkpoint are not tokenised again
    most = 48 + cache.longest_added + 1
    assert cache.stats.encoded_chars < len(system) + 19 * most
    cache.check_integrity()


def test_a_shared_prefix_stays_a_hit_past_capacity(tokenizer: Tokenizer) -> None:
    """A hit touches the text holding the shared prefix's checkpoints, so newer texts
    that share it do not push it out."""
    rng = random.Random(3)
    system = " ".join(rng.choice("abcdefghij") for _ in range(64))
    cache = TokenPrefixCache(tokenizer, capacity=3, stride=8)
    for i in range(12):
        text = f"{system} question {i}"
        assert cache.encode(text) == full(tokenizer, text)
        cache.check_integrity()
    assert (cache.stats.misses, cache.stats.hits) == (1, 11)


def test_capacity_evicts_the_least_recently_used(tokenizer: Tokenizer) -> None:
    cache = TokenPrefixCache(tokenizer, capacity=2, stride=8)
    for text in ("first text " * 4, "second one " * 4, "third text " * 4):
        cache.encode(text)
    assert len(cache) == 2
    cache.check_integrity()
    assert cache.encode("first text " * 4 + "more") == full(tokenizer, "first text " * 4 + "more")
    assert cache.stats.hits == 0


def test_only_tokenizers_the_cut_argument_covers_are_supported(tokenizer: Tokenizer) -> None:
    assert TokenPrefixCache.supports(tokenizer)
    prefixed = Tokenizer.from_str(tokenizer.to_str())
    prefixed.pre_tokenizer = pre_tokenizers.Metaspace()
    assert not TokenPrefixCache.supports(prefixed)
    spaced = Tokenizer.from_str(tokenizer.to_str())
    spaced.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    assert not TokenPrefixCache.supports(spaced)


def test_texts_are_reused_only_within_their_namespace(tokenizer: Tokenizer) -> None:
    cache = TokenPrefixCache(tokenizer, stride=8)
    text = "a shared system prompt, long enough for several checkpoints. "
    cache.encode(text + "alice asks", "alice")
    assert cache.encode(text + "mallory asks", "mallory") == full(tokenizer,
                                                                  text + "mallory asks")
    assert (cache.stats.hits, cache.stats.misses) == (0, 2)
    cache.encode(text + "alice again", "alice")
    assert (cache.stats.hits, cache.stats.misses) == (1, 2)
    cache.check_integrity()


def test_keying_a_long_text_is_linear(tokenizer: Tokenizer) -> None:
    """A hostile 512 KiB prompt: keying its 16,320 checkpoints hashes each character once
    (prefix-by-prefix hashing would read ~4·10⁹ characters)."""
    cache = TokenPrefixCache(tokenizer, stride=32)
    text = "ab " * (170 << 10)
    keys = cache._keys(text, "mallory")
    assert len(keys) == len(text) // cache.stride and len(set(keys)) == len(keys)
    assert cache._keys(text[:96] + "x", "mallory")[:3] == keys[:3]
    assert cache._keys(text[:96], "alice") != keys[:3]


def test_the_token_budget_bounds_what_long_prompts_keep(tokenizer: Tokenizer) -> None:
    cache = TokenPrefixCache(tokenizer, capacity=100, stride=8, max_tokens=200)
    for i in range(6):
        text = f"prompt {i}: " + "lorem ipsum " * 20  # ~45 tokens each
        assert cache.encode(text) == full(tokenizer, text)
        cache.check_integrity()
    assert cache.held_tokens <= 200 and len(cache) < 6  # the oldest went for the budget
    huge = "x " * 500  # longer than the whole budget: tokenised, not kept
    assert cache.encode(huge) == full(tokenizer, huge)
    assert huge not in {e.text for e in cache._texts.values()}
    cache.check_integrity()


def test_a_short_reuse_reads_only_the_cuts_it_needs(tokenizer: Tokenizer) -> None:
    """A short text sharing the head of a long one reads the long one's cuts up to the
    shared part only (reading all of them took 157 ms at 96 Ki tokens, on the event loop
    in the router); longer reuses later read on from there; all are exact."""
    rng = random.Random(3)
    long = " ".join(rng.choice(["alpha", "beta", "12", "it's", "\n"]) for _ in range(20_000))
    cache = TokenPrefixCache(tokenizer, stride=16)
    cache.encode(long)
    (entry,) = cache._texts.values()
    assert entry.pending is not None and entry.pending[3] == 1
    for shared in (300, 40_000, len(long) - 10):
        text = long[:shared] + " zeta"
        got = cache.encode_prefixed(text)
        assert got.ids == full(tokenizer, text)
        assert got.reused >= len(full(tokenizer, long[:shared - 8]))
        if shared == 300:  # read to just past the cut, not the 30 Ki tokens after it
            assert entry.pending is not None and entry.pending[3] <= got.reused + 8
        cache.check_integrity()
