"""Tokenizer (tokenizers BPE built from GGUF metadata) and chat-template rendering."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from native_engine.model.chat_template import ChatTemplate, ChatTemplateError
from native_engine.model.tokenizer import TextTokenizer, build_bpe_tokenizer, encode_text
from native_engine.model.weights import load_model
from tests.native_engine.tiny_model import CHATML_TEMPLATE, byte_tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BYTES = TextTokenizer(byte_tokenizer(SPECIALS), "<|im_start|>", "<|im_end|>")


@settings(max_examples=100, deadline=None)
@given(st.text())
def test_byte_tokenizer_round_trips_any_text(text: str) -> None:
    assert BYTES.decode(BYTES.encode(text), skip_special_tokens=False) == text


def test_special_tokens_are_single_ids() -> None:
    assert BYTES.encode("<|im_start|>user\nhi<|im_end|>")[:1] == [1]
    assert BYTES.encode("<|im_end|>") == [2]
    assert BYTES.stop_token_ids == (0, 2)
    assert BYTES.decode([1, *BYTES.encode("hi"), 2]) == "hi"


def test_decode_stream_yields_whole_characters() -> None:
    ids = BYTES.encode("né✓")
    stream = BYTES.decode_stream()
    pieces = [stream.step(BYTES.backend, i) for i in ids]
    assert "".join(p for p in pieces if p) == "né✓"


def test_bad_vocabularies_are_rejected() -> None:
    with pytest.raises(ValueError, match="malformed merge"):
        build_bpe_tokenizer(["a", "b", "ab"], [1, 1, 1], ["ab"], "gpt2")
    with pytest.raises(ValueError, match="unsupported pre-tokenizer"):
        build_bpe_tokenizer(["a"], [1], [], "qwen2")
    with pytest.raises(ValueError, match="not in the vocabulary"):
        TextTokenizer(byte_tokenizer(SPECIALS), "<s>", None)


SYSTEM_USER = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there"},
]
CHATML_EXPECTED = (
    "<|im_start|>system\nYou are terse.<|im_end|>\n"
    "<|im_start|>user\nHi there<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def test_chatml_template_renders_like_hf() -> None:
    template = ChatTemplate(CHATML_TEMPLATE, "<|im_start|>", "<|im_end|>")
    assert template.render(SYSTEM_USER) == CHATML_EXPECTED
    assert template.render(SYSTEM_USER, add_generation_prompt=False) == CHATML_EXPECTED[:-22]


def test_template_helpers_and_errors() -> None:
    raising = ChatTemplate("{{ raise_exception('no ' + messages[0]['role']) }}", None, None)
    with pytest.raises(ChatTemplateError, match="no user"):
        raising.render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="compile"):
        ChatTemplate("{% for %}", None, None)
    dumped = ChatTemplate("{{ messages | tojson }}{{ bos_token }}", "<s>", None)
    rendered = dumped.render([{"role": "user", "content": "é"}])
    assert rendered == '[{"role": "user", "content": "é"}]<s>'
    sandboxed = ChatTemplate("{{ messages.__class__.__mro__ }}", None, None)
    with pytest.raises(ChatTemplateError):
        sandboxed.render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="role"):
        ChatTemplate(CHATML_TEMPLATE, None, None).render([{"content": "x"}])
    with pytest.raises(ChatTemplateError, match="list"):
        ChatTemplate(CHATML_TEMPLATE, None, None).render("hello")  # type: ignore[arg-type]


# --- the real SmolLM2 tokenizer from the embedded GGUF ---------------------------------------


@pytest.fixture(scope="module")
def smollm_tokenizer() -> tuple[TextTokenizer, ChatTemplate]:
    model = load_model(None, torch.float32)
    assert model.chat_template is not None
    return model.tokenizer, model.chat_template


@pytest.mark.slow
def test_smollm_special_tokens(smollm_tokenizer: tuple) -> None:
    tok, _ = smollm_tokenizer
    assert tok.vocab_size == 49152
    assert tok.encode("<|endoftext|>") == [0]
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_end|>") == [2]
    assert (tok.bos_token, tok.bos_token_id) == ("<|im_start|>", 1)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert tok.stop_token_ids == (0, 2)


@pytest.mark.slow
def test_smollm_encoding_round_trips(smollm_tokenizer: tuple) -> None:
    tok, _ = smollm_tokenizer
    texts = ["Hello, world!", "The year 2024 had 366 days.", "  def f(x):\n\treturn x**2\n",
             "naïve café — 東京 🙂", "What is the capital of France?"]
    for text in texts:
        assert tok.decode(tok.encode(text)) == text
    # The smollm pre-tokenizer splits every digit.
    assert len(tok.encode("2024")) == 4
    assert tok.encode("system\n") == [9690, 198]
    # Common words are single tokens with a leading-space marker.
    assert len(tok.encode(" capital")) == 1


@pytest.mark.slow
def test_smollm_chat_template(smollm_tokenizer: tuple) -> None:
    tok, template = smollm_tokenizer
    assert template.render(SYSTEM_USER) == CHATML_EXPECTED
    default_system = template.render([{"role": "user", "content": "Hi there"}])
    assert default_system.startswith("<|im_start|>system\nYou are a helpful AI assistant")
    ids = tok.encode(template.render(SYSTEM_USER))
    assert ids[0] == 1 and ids.count(2) == 2 and ids[-4:] == tok.encode("<|im_start|>assistant\n")


@pytest.mark.slow
def test_encoding_leaves_other_threads_running(smollm_tokenizer: tuple) -> None:
    """A long prompt tokenised on a worker thread must not stall the event loop's thread:
    `Tokenizer.encode` held the GIL throughout (0 to 1 ticks of a 1 ms sleeper in ~0.6 s),
    `TextTokenizer.encode` (offset-free) and `encode_text` (with offsets, for the
    token-prefix cache) let it run. The ids are `Tokenizer.encode`'s on both."""
    tok, _ = smollm_tokenizer
    for text in ("Hello, world! <|im_end|> 2024", "naïve café — 東京 🙂 <|im_start|>" * 300):
        expected = tok.backend.encode(text, add_special_tokens=False).ids
        assert tok.encode(text) == encode_text(tok.backend, text).ids == expected
    ticks, done = [], threading.Event()

    def ticker() -> None:
        while not done.is_set():
            time.sleep(0.001)
            ticks.append(time.perf_counter())

    long = "a " * 400_000
    thread = threading.Thread(target=ticker)
    thread.start()
    time.sleep(0.05)
    started = time.perf_counter()
    ids = tok.encode(long)
    ended = time.perf_counter()
    done.set()
    thread.join()
    assert len(ids) == 400_001
    during = [t for t in ticks if started < t < ended]
    assert len(during) >= 20, (len(during), ended - started)
