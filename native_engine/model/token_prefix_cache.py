"""Token ids of a text that shares a prefix with a text tokenised before, without
tokenising the shared part again (the KV-aware router's hot path: prompts that start with
the same system prompt).

Why a cut is exact. For the tokenizers `supports()` accepts (BPE over a byte-level
pre-tokenizer with GPT-2's regex, optionally digits split first; no normalizer; added
tokens matched verbatim), the ids of a text are the concatenation of the ids of its
pre-tokens, each encoded on its own. Take a boundary `c` between two pre-tokens of a text
T, and a text U with U[:L] == T[:L] where c <= L - margin. Every pre-token of U that ends
at or before c is decided by characters before c + 3 (the regex's longest look past a
match is one character; its contractions read three), and every added token that starts
before c ends before c + longest added token, so U splits at c exactly as T does; after c
the regex has no look-behind, so U[c:] pre-tokenises as U does from c. Hence
ids(U) == ids(T)[:n] + ids(U[c:]), n being T's token count before c. Boundaries are read
from the tokenizer's own word ids and offsets (two tokens of different pre-tokens whose
offsets touch), never re-derived here. The property test compares with a full encode.

Checkpoints every `stride` characters map a chained hash of a text's prefix (each key
hashes the previous one with the next `stride` characters, so keying a text is linear in
its length, never quadratic) to the most recent text holding it; a lookup binary-searches
the longest verified prefix (prefixes shared at L are shared at every shorter L), then
the characters that text shares past it, so only the new part (and `margin` characters
before it) is tokenised. Texts are kept in LRU order, at most `capacity` of them and
`max_tokens` token ids in all (a longer text is tokenised and not kept): the budget, not
the count, bounds the memory a client's long prompts can take. A text's last tokenised
stretch keeps its encoding, and its cuts are read from it only when another text reuses
that stretch, as far as that reuse needs (most texts are a shared prefix plus a suffix no
one sends again; a short text sharing the head of a long one reads a few cuts, not the
long one's all: 157 ms on a 96 Ki-token text, most of it building its offsets list).

Texts are shared only within a `namespace` (the router passes the tenant): a cache shared
across tenants would let one time whether another sent a prompt (a hit is faster), the
prompt-cache side channel of docs/security.md SEC-5 at a smaller scale.

`encode_prefixed` also gives each kept text a `memo` for what a caller derives from its ids
(the router keeps its block-hash chains there), kept and dropped with the text, and the memo
of the text whose leading ids were reused: what was derived there holds for the first
`reused` ids, so a caller extends it over the new ids only.
"""

from __future__ import annotations

import bisect
import json
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Encoding, Tokenizer

from native_engine.model.tokenizer import encode_text

# How far the pre-tokenizer's regex reads past the start of a match that ends at a cut.
REGEX_LOOKAHEAD = 3


@dataclass(eq=False, slots=True)
class _Text:
    """A tokenised text and its exact cuts: `cuts[i]` is a character position where the
    ids split (0 first), `counts[i]` the tokens before it."""

    namespace: str | None
    text: str
    ids: list[int]
    cuts: list[int] = field(default_factory=lambda: [0])
    counts: list[int] = field(default_factory=lambda: [0])
    keys: list[int] = field(default_factory=list)
    # (character, token, encoding, next token) of the last tokenised stretch: its cuts
    # are read up to that token
    pending: tuple[int, int, Encoding, int] | None = None
    memo: dict[Hashable, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PrefixedIds:
    """A text's ids (the caller's copy); the first `reused` equal the ids of an earlier text
    whose memo is `base_memo` (None: nothing reused); `memo` is this text's."""

    ids: list[int]
    reused: int
    memo: dict[Hashable, Any]
    base_memo: dict[Hashable, Any] | None


@dataclass(frozen=True, slots=True)
class PrefixLookup:
    """`TokenPrefixCache.lookup`'s answer: the first `count` ids of `text` are those of
    `base`, a kept text (0 and None when none shares a checkpointed prefix), and they end
    at character `cut` (`len(text)`: the text was seen whole). `keys` and `base`'s first
    `held` cuts: what `complete` keeps of it.

    Nothing of `base` is copied here: a kept text's ids and cuts only ever grow at their
    end, so their prefixes read later are the ones of now. A routing decision reads only
    `count` (a copy of a few hundred ids touches every id object, and between requests
    the caches are cold); `complete` copies them once."""

    text: str
    namespace: str | None
    keys: list[int]
    base: _Text | None
    cut: int
    count: int
    held: int

    @property
    def ids(self) -> list[int]:
        """The known ids (a copy)."""
        return [] if self.base is None else self.base.ids[:self.count]

    @property
    def base_memo(self) -> dict[Hashable, Any] | None:
        return None if self.base is None else self.base.memo

    def tokens_after_at_most(self) -> int:
        """An upper bound on the ids after `ids`: one per UTF-8 byte of the rest (a BPE
        token over byte-level pre-tokens, or an added token, covers one byte or more)."""
        return len(self.text[self.cut:].encode("utf-8", "surrogatepass"))


@dataclass(slots=True)
class TokenPrefixCacheStats:
    hits: int = 0
    misses: int = 0
    reused_tokens: int = 0
    encoded_chars: int = 0


def _pre_tokenizer_ok(pre: dict[str, Any] | None) -> bool:
    if pre is None:
        return False
    kind = pre.get("type")
    if kind == "ByteLevel":
        return bool(pre.get("use_regex", True)) and not pre.get("add_prefix_space", False)
    if kind == "Sequence":
        parts = pre.get("pretokenizers") or []
        return bool(parts) and all(p.get("type") == "Digits" for p in parts[:-1]) and \
            _pre_tokenizer_ok(parts[-1])
    return False


def _shared_length(a: str, b: str, known: int) -> int:
    """Length of the common prefix of `a` and `b`, known to be at least `known`: a binary
    search of slice comparisons (C memcmp), so a checkpoint's stride is not re-tokenised."""
    low, high = known, min(len(a), len(b))
    while low < high:
        mid = (low + high + 1) // 2
        if a[low:mid] == b[low:mid]:
            low = mid
        else:
            high = mid - 1
    return low


class TokenPrefixCache:
    """`encode(text, namespace)` equal to `tokenizer.encode(text, add_special_tokens=False)
    .ids`; only texts of the same namespace are reused."""

    def __init__(self, tokenizer: Tokenizer, capacity: int = 1024, stride: int = 128,
                 max_tokens: int = 1 << 20) -> None:
        if capacity < 1 or stride < 1 or max_tokens < 1:
            raise ValueError("capacity, stride and max_tokens must be >= 1")
        self.tokenizer, self.capacity, self.stride = tokenizer, capacity, stride
        self.max_tokens, self.held_tokens = max_tokens, 0
        added = [t.content for t in tokenizer.get_added_tokens_decoder().values()]
        self.longest_added = max(map(len, added), default=0)
        self._added_starts = frozenset(t[0] for t in added if t)
        self._texts: OrderedDict[int, _Text] = OrderedDict()
        self._checkpoints: dict[int, _Text] = {}
        self.stats = TokenPrefixCacheStats()

    @staticmethod
    def supports(tokenizer: Tokenizer) -> bool:
        """Whether the cut argument of the module docstring holds for this tokenizer."""
        spec = json.loads(tokenizer.to_str())
        added_plain = all(not (t.get("lstrip") or t.get("rstrip") or t.get("single_word")
                               or t.get("normalized"))
                          for t in spec.get("added_tokens") or [])
        return (spec.get("normalizer") is None and (spec.get("model") or {}).get("type") ==
                "BPE" and _pre_tokenizer_ok(spec.get("pre_tokenizer")) and added_plain)

    def encode(self, text: str, namespace: str | None = None) -> list[int]:
        return self.encode_prefixed(text, namespace).ids

    def encode_prefixed(self, text: str, namespace: str | None = None) -> PrefixedIds:
        return self.complete(self.lookup(text, namespace))

    def lookup(self, text: str, namespace: str | None = None) -> PrefixLookup:
        """What the cache knows of `text`'s ids without tokenising anything: the leading
        ids an earlier text of `namespace` fixes (all of them for a text seen before).
        `complete` tokenises the rest; other texts may be looked up or completed between
        the two (a lookup holds its own copies)."""
        keys = self._keys(text, namespace)
        base, length = self._longest(text, namespace, keys)
        if base is None:
            self.stats.misses += 1
            return PrefixLookup(text, namespace, keys[length // self.stride:], None, 0, 0, 0)
        self.stats.hits += 1
        self._texts.move_to_end(id(base))
        if base.text == text:
            return PrefixLookup(text, namespace, [], base, len(text), len(base.ids), 0)
        shared = _shared_length(text, base.text, length)
        limit = shared - self.margin(text, shared)
        self._read_cuts(base, limit)
        i = max(bisect.bisect_right(base.cuts, limit) - 1, 0)
        return PrefixLookup(text, namespace, keys[length // self.stride:], base,
                            base.cuts[i], base.counts[i], i + 1)

    def complete(self, found: PrefixLookup) -> PrefixedIds:
        """`found`'s text's ids: its known ids, then the rest tokenised (and the text kept)."""
        base, count = found.base, found.count
        self.stats.reused_tokens += count
        if base is not None and found.cut == len(found.text):
            return PrefixedIds(found.ids, count, base.memo, base.memo)
        cuts, counts = ([0], [0]) if base is None else (base.cuts[:found.held],
                                                       base.counts[:found.held])
        entry = _Text(found.namespace, found.text, found.ids, cuts, counts)
        self._extend(entry, found.cut, count, found.text[found.cut:])
        self._remember(entry, found.keys)
        return PrefixedIds(list(entry.ids), count, entry.memo,
                           None if base is None else base.memo)

    def margin(self, text: str, length: int) -> int:
        """How far before a shared length `length` a cut must be: past the regex's look,
        and past any added token that could start before the cut and end after `length`
        (none can where no added token's first character is in the last stretch)."""
        window = text[max(length - self.longest_added, 0):length]
        if not self._added_starts.isdisjoint(window):
            return max(REGEX_LOOKAHEAD, self.longest_added) + 1
        return REGEX_LOOKAHEAD + 1

    def _keys(self, text: str, namespace: str | None) -> list[int]:
        """Key of each checkpointed prefix of `text` (lengths stride, 2·stride, ...)."""
        keys, key = [], hash(namespace)
        for start in range(0, len(text) - self.stride + 1, self.stride):
            key = hash((key, text[start:start + self.stride]))
            keys.append(key)
        return keys

    def _longest(self, text: str, namespace: str | None,
                 keys: list[int]) -> tuple[_Text | None, int]:
        """The text of `namespace` holding the longest checkpointed prefix of `text`, and
        that length."""
        low, high = 1, len(keys)
        best, found = None, 0
        while low <= high:
            mid = (low + high) // 2
            holder = self._checkpoints.get(keys[mid - 1])
            length = mid * self.stride
            if holder is not None and holder.namespace == namespace and \
                    len(holder.text) >= length and text.startswith(holder.text[:length]):
                best, found, low = holder, length, mid + 1
            else:
                high = mid - 1
        return best, found

    def _extend(self, entry: _Text, cut: int, count: int, tail: str) -> None:
        encoding = encode_text(self.tokenizer, tail)
        self.stats.encoded_chars += len(tail)
        entry.ids.extend(encoding.ids)
        entry.pending = (cut, count, encoding, 1) if len(encoding) > 1 else None

    @staticmethod
    def _read_cuts(entry: _Text, limit: int) -> None:
        """Append the cuts of `entry`'s pending encoding at characters up to `limit`,
        token by token from where the last read stopped (token starts ascend)."""
        if entry.pending is None:
            return
        cut, count, encoding, token = entry.pending
        chars, word = encoding.token_to_chars, encoding.token_to_word
        before, before_word = chars(token - 1), word(token - 1)
        while token < len(encoding):
            here, here_word = chars(token), word(token)
            assert before is not None and here is not None  # one sequence: every token
            if cut + here[0] > limit:
                entry.pending = (cut, count, encoding, token)
                return
            if here_word != before_word and before[1] == here[0]:
                entry.cuts.append(cut + here[0])
                entry.counts.append(count + token)
            before, before_word, token = here, here_word, token + 1
        entry.pending = None

    def _remember(self, entry: _Text, keys: list[int]) -> None:
        """Checkpoints past the prefix already held by another text (that one stays the
        holder; it was just touched)."""
        if len(entry.ids) > self.max_tokens:
            return
        for key in keys:
            self._checkpoints[key] = entry
            entry.keys.append(key)
        self._texts[id(entry)] = entry
        self.held_tokens += len(entry.ids)
        while len(self._texts) > self.capacity or self.held_tokens > self.max_tokens:
            _, old = self._texts.popitem(last=False)
            self.held_tokens -= len(old.ids)
            for key in old.keys:
                if self._checkpoints.get(key) is old:
                    del self._checkpoints[key]

    def __len__(self) -> int:
        return len(self._texts)

    def check_integrity(self) -> None:
        """Every checkpoint's holder is a kept text; cuts ascend with their counts and
        end before a pending encoding; the token budget holds."""
        assert len(self._texts) <= self.capacity
        assert self.held_tokens == sum(len(e.ids) for e in self._texts.values())
        assert self.held_tokens <= self.max_tokens
        kept = set(self._texts)
        for holder in self._checkpoints.values():
            assert id(holder) in kept, "a checkpoint names an evicted text"
        for entry in self._texts.values():
            assert entry.cuts[0] == 0 and entry.counts[0] == 0
            assert entry.cuts == sorted(entry.cuts) and entry.counts == sorted(entry.counts)
            assert entry.counts[-1] <= len(entry.ids)
            if entry.pending is not None:
                cut, count, encoding, token = entry.pending
                assert count + len(encoding) == len(entry.ids) and 0 < token < len(encoding)
                start = encoding.token_to_chars(token)
                assert start is not None and entry.cuts[-1] <= cut + start[0]
