"""Incremental detokenisation equals a full decode after every token, on real tokenizers."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from native_engine.detokenizer import IncrementalDetokenizer
from native_engine.model.tokenizer import TextTokenizer
from native_engine.model.weights import load_model
from tests.native_engine.tiny_model import byte_tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BYTES = TextTokenizer(byte_tokenizer(SPECIALS), "<|im_start|>", "<|im_end|>")


def assert_incremental_equals_full(tok: TextTokenizer, ids: list[int]) -> None:
    detok = IncrementalDetokenizer(tok)
    for i, token in enumerate(ids):
        assert detok.push(token) == tok.decode(ids[: i + 1])
        detok.check_integrity()


@settings(max_examples=150, deadline=None)
@given(st.text(min_size=1, max_size=40))
def test_byte_tokens_split_every_character(text: str) -> None:
    """One token per byte: multi-byte characters arrive over several tokens."""
    assert_incremental_equals_full(BYTES, BYTES.encode(text))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, BYTES.vocab_size - 1), min_size=1, max_size=40))
def test_byte_tokens_any_sequence_with_invalid_utf8_and_specials(ids: list[int]) -> None:
    assert_incremental_equals_full(BYTES, ids)


@pytest.fixture(scope="module")
def smollm() -> TextTokenizer:
    return load_model(None, torch.float32).tokenizer


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, 49151), min_size=1, max_size=60))
def test_smollm_any_sequence(smollm: TextTokenizer, ids: list[int]) -> None:
    assert_incremental_equals_full(smollm, ids)


@pytest.mark.slow
def test_smollm_text_with_emoji_and_cjk(smollm: TextTokenizer) -> None:
    ids = smollm.encode("naïve café — 東京 🎉🎉 done\n\tdef f(x): return x")
    assert_incremental_equals_full(smollm, ids)
