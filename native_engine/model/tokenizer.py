"""Byte-level BPE tokenizer (built with the `tokenizers` library) and its special tokens."""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import AddedToken, Encoding, Tokenizer, decoders, models, pre_tokenizers, processors

# llama.cpp's pre-tokenizer names whose regex is GPT-2's with every digit split off
# (HF: Sequence[Digits(individual_digits), ByteLevel]).
DIGIT_SPLIT_PRE = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"})
PLAIN_GPT2_PRE = frozenset({"gpt2", "default", "mpt", "olmo", "jais"})

# Texts this long are tokenised with the GIL released (`encode_text`, `TextTokenizer.encode`).
GIL_RELEASE_CHARS = 4096

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# Texts that end generation, as llama.cpp detects them when the GGUF does not say.
END_OF_GENERATION_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
    "<|eom_id|>", "<EOT>", "<|end_of_text|>",
)


def encode_text(backend: Tokenizer, text: str) -> Encoding:
    """`backend.encode(text, add_special_tokens=False)`, without holding the GIL while it
    works on a long text. `Tokenizer.encode` holds it throughout, so a thread tokenising a
    long prompt off the event loop still stalled the loop (an 800 KiB prompt: 700 ms, 674 ms
    of it with no other thread running); `encode_batch` releases it (longest stall 20 ms,
    the list of ids being built), for the same ids. It hands the work to the tokenizers
    library's thread pool, +20 µs on a short text after an idle gap, so short texts (≤ 1.3
    ms of GIL) are encoded in place. For ids alone `TextTokenizer.encode` is cheaper: an
    `Encoding` with offsets holds the GIL while it is freed too."""
    if len(text) < GIL_RELEASE_CHARS:
        return backend.encode(text, add_special_tokens=False)
    return backend.encode_batch([text], add_special_tokens=False)[0]


def byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The HF pre-tokenizer equivalent to llama.cpp's `tokenizer.ggml.pre` name."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True,
                                          use_regex=True)
    if pre in DIGIT_SPLIT_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        byte_level])
    if pre in PLAIN_GPT2_PRE:
        return byte_level
    raise ValueError(f"unsupported pre-tokenizer {pre!r}; supported: "
                     f"{sorted(DIGIT_SPLIT_PRE | PLAIN_GPT2_PRE)}")


def build_bpe_tokenizer(
    tokens: Sequence[str],
    token_types: Sequence[int],
    merges: Sequence[str],
    pre: str,
) -> Tokenizer:
    """A byte-level BPE tokenizer from GGUF-style vocab, token types and merges."""
    if len(tokens) != len(token_types):
        raise ValueError("token and token-type lists differ in length")
    vocab = {text: i for i, text in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("duplicate token texts in the vocabulary")
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep or not left or not right:
            raise ValueError(f"malformed merge {merge!r}")
        pairs.append((left, right))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = byte_level_pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    added = [
        AddedToken(text, special=kind == TOKEN_TYPE_CONTROL, normalized=False)
        for text, kind in zip(tokens, token_types, strict=True)
        if kind in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)
    ]
    tok.add_tokens(added)
    return tok


class TextTokenizer:
    """Encode/decode plus the ids that matter to generation (BOS, EOS, stop tokens)."""

    def __init__(
        self,
        backend: Tokenizer,
        bos_token: str | None,
        eos_token: str | None,
        extra_stop_ids: Sequence[int] = (),
    ) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = self._id_of(bos_token)
        self.eos_token_id = self._id_of(eos_token)
        stops = {i for i in extra_stop_ids if 0 <= i < self.vocab_size}
        stops.update(i for i in map(backend.token_to_id, END_OF_GENERATION_TEXTS)
                     if i is not None)
        if self.eos_token_id is not None:
            stops.add(self.eos_token_id)
        self.stop_token_ids: tuple[int, ...] = tuple(sorted(stops))

    def _id_of(self, text: str | None) -> int | None:
        if text is None:
            return None
        token_id = self.backend.token_to_id(text)
        if token_id is None:
            raise ValueError(f"special token {text!r} is not in the vocabulary")
        return token_id

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token texts inside it map to their ids (as in HF).
        A long text goes through `encode_batch_fast` (GIL released, no offsets): freeing
        an `Encoding` with offsets holds the GIL too, 122 ms for a 690,000-token chat, and
        tokenising took twice as long."""
        if len(text) < GIL_RELEASE_CHARS:
            return self.backend.encode(text, add_special_tokens=False).ids
        return self.backend.encode_batch_fast([text], add_special_tokens=False)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = True) -> decoders.DecodeStream:
        """Incremental detokenizer: `.step(backend, token_id)` yields text or None."""
        return decoders.DecodeStream(skip_special_tokens=skip_special_tokens)

    def token_to_id(self, text: str) -> int | None:
        return self.backend.token_to_id(text)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def to_json(self) -> str:
        return self.backend.to_str()
