"""The cache-control part of the engine contract: what a quarantine asks of an engine and
what the engine answers (docs/design.md §3, §5; SEC-10, SEC-11).

A driver's `cache_control` implements these calls or answers `CacheControlUnsupported`;
the engine's capabilities say which work (`exact_span_evict`, `prefix_reset`, `kv_events`).
The governor decides; these records only carry facts.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from schemas.kv_events import BlockHash
from schemas.values import is_int

__all__ = ["BlockHash"]  # re-exported: the records below name it


class CacheControlUnsupported(RuntimeError):
    """The engine does not offer this call (its capabilities say so too)."""


@dataclass(frozen=True, slots=True)
class SpanSpec:
    """A span as the operator gave it: exactly one of `text` (a completions prompt),
    `messages` (chat messages, rendered with the generation prompt), `token_ids`."""

    text: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        given = [n for n in ("text", "messages", "token_ids") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(f"a span needs exactly one of text, messages, token_ids; got "
                             f"{given or 'none'}")
        if self.token_ids is not None and not all(is_int(t) and t >= 0
                                                  for t in self.token_ids):
            raise ValueError("token_ids must be ints >= 0")

    def to_json(self) -> dict[str, Any]:
        if self.text is not None:
            return {"text": self.text}
        if self.messages is not None:
            return {"messages": list(self.messages)}
        return {"token_ids": list(self.token_ids or ())}

    @classmethod
    def from_json(cls, raw: Any) -> SpanSpec:
        if not isinstance(raw, dict) or set(raw) - {"text", "messages", "token_ids"}:
            raise ValueError("span must be an object with one of text, messages, token_ids")
        messages, token_ids = raw.get("messages"), raw.get("token_ids")
        if messages is not None and not (isinstance(messages, list) and messages
                                         and all(isinstance(m, dict) for m in messages)):
            raise ValueError("span.messages must be a non-empty list of objects")
        if token_ids is not None and not isinstance(token_ids, list):
            raise ValueError("span.token_ids must be a list")
        text = raw.get("text")
        if text is not None and (not isinstance(text, str) or not text):
            raise ValueError("span.text must be a non-empty string")
        return cls(text, None if messages is None else tuple(messages),
                   None if token_ids is None else tuple(token_ids))


@dataclass(frozen=True, slots=True)
class SpanEviction:
    """The engine's own account of one exact-span eviction.

    `span_tokens`: the span's length as the engine tokenised it; `evicted_tokens`: cached
    tokens dropped (the span from `start` and everything derived from it); `removed_blocks`:
    the full blocks that left the cache, as its KV events name them; `kv_seq`: the KV-event
    batch the removal went out in (None: none published); `problems`: what the engine's own
    checks of its cache found wrong (empty: the cut is exact); `checks`: what they confirmed.
    """

    span_tokens: int
    evicted_tokens: int
    removed_blocks: frozenset[BlockHash]
    kv_seq: int | None
    problems: tuple[str, ...] = ()
    checks: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"span_tokens": self.span_tokens, "evicted_tokens": self.evicted_tokens,
                "removed_blocks": sorted(_hash_json(h) for h in self.removed_blocks),
                "kv_seq": self.kv_seq, "problems": list(self.problems),
                "checks": list(self.checks)}

    @classmethod
    def from_json(cls, raw: Any) -> SpanEviction:
        if not isinstance(raw, dict):
            raise ValueError("an eviction result must be an object")
        span_tokens, evicted = raw.get("span_tokens"), raw.get("evicted_tokens")
        if not (is_int(span_tokens) and is_int(evicted) and min(span_tokens, evicted) >= 0):
            raise ValueError("span_tokens and evicted_tokens must be ints >= 0")
        seq = raw.get("kv_seq")
        if seq is not None and not is_int(seq):
            raise ValueError("kv_seq must be an int or null")
        blocks = raw.get("removed_blocks")
        if not isinstance(blocks, list):
            raise ValueError("removed_blocks must be a list")
        return cls(span_tokens, evicted, frozenset(_hash_of(h) for h in blocks), seq,
                   _strings(raw.get("problems", [])), _strings(raw.get("checks", [])))


def _hash_json(h: BlockHash) -> str | int:
    return h.hex() if isinstance(h, bytes) else h


def _hash_of(value: Any) -> BlockHash:
    if is_int(value) and value >= 0:
        return int(value)
    if isinstance(value, str):
        return bytes.fromhex(value)
    raise ValueError(f"not a block hash: {value!r}")


def _strings(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError("expected a list of strings")
    return tuple(value)


class ResetOutcome(enum.StrEnum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class ResetResult:
    """A whole-prefix reset: the outcome, the HTTP status (0 in process), the reply text."""

    outcome: ResetOutcome
    status: int
    body: str


@dataclass(frozen=True, slots=True)
class KVMark:
    """Where each rank's KV-event stream stood: (rank, last seq) pairs; `detail` is the
    driver's own watermark record, opaque to callers."""

    points: tuple[tuple[int, int | None], ...]
    detail: Any = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class KVRemoval:
    """What the KV events after a mark show: the removed blocks, whether every medium was
    cleared, the seq range read, and whether no batch was lost in between (every rank)."""

    gap_free: bool
    removed: frozenset[BlockHash]
    cleared: bool
    seq_from: int | None
    seq_to: int | None
