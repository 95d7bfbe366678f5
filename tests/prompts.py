"""Random prompts that share no first token. The native engine's radix cache matches single
tokens, so two random-letter prompts opening with the same letter share one cached token
(CI runs saw `cached_tokens` 1 and 2 for "fresh" prompts), and a span cut from 0 takes every
path that shares its first token. Each prompt of one `FreshPrompts` opens with its own
capital letter."""

from __future__ import annotations

import random
import string


class FreshPrompts:
    def __init__(self) -> None:
        self._openers = iter(string.ascii_uppercase)
        self._rng = random.Random()

    def words(self, count: int) -> str:
        """`count` space-separated letters, the first a capital no earlier prompt had."""
        opener = next(self._openers, None)
        if opener is None:
            raise RuntimeError("FreshPrompts has no opener left past 26 prompts")
        rest = (self._rng.choice(string.ascii_lowercase) for _ in range(count - 1))
        return " ".join((opener, *rest))
