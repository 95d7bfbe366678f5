"""Incremental detokenisation: a request's text grows by decoding a short window per token.

Decoding a request's whole output every step costs O(n) per token (O(n^2) per request). Here
each new token decodes only the ids since the last point where the text was complete (vLLM's
prefix/read-offset scheme): `prefix` = decode(ids[prefix_offset:read_offset]) and `window` =
decode(ids[prefix_offset:]); the text gained is window[len(prefix):]. The offsets advance only
when the window ends in a complete character, so `prefix_offset` always sits on a character
boundary of the full decode.

Invariant (checked by `check_integrity` and the tests): `text` == decode(ids) of every id
pushed, for byte-level BPE decoders, which is what the engine emitted before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """The decoded text of the ids pushed so far, maintained in O(window) per token."""

    __slots__ = ("_decoder", "_ids", "_prefix_offset", "_read_offset", "_stable", "text")

    def __init__(self, decoder: Decoder) -> None:
        self._decoder = decoder
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._stable = ""  # decode(ids[:read_offset]): text ending on a complete character
        self.text = ""

    def push(self, token_id: int) -> str:
        """Add one id; returns the whole text so far (decode of every pushed id)."""
        self._ids.append(token_id)
        ids = self._ids
        prefix = self._decoder.decode(ids[self._prefix_offset : self._read_offset])
        window = self._decoder.decode(ids[self._prefix_offset :])
        gained = window[len(prefix) :]
        if len(window) > len(prefix) and not window.endswith("\ufffd"):
            self._stable += gained
            self._prefix_offset, self._read_offset = self._read_offset, len(ids)
            self.text = self._stable
        else:  # an incomplete UTF-8 sequence at the end: keep it out of the stable text
            self.text = self._stable + gained
        return self.text

    def check_integrity(self) -> None:
        """`text` equals a full decode of every id pushed (the slow way, for tests)."""
        assert self.text == self._decoder.decode(self._ids), "incremental text diverged"
        assert self.text.startswith(self._stable)
        assert 0 <= self._prefix_offset <= self._read_offset <= len(self._ids)
