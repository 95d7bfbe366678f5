"""What the lower KV tiers (host RAM, disk) know about one full block they hold.

A block is named by its salted chain digest (native_engine.kvcache.block_hash: the digest the
KV events publish), so two tenants' blocks never share a name even with equal tokens. The
digest commits to the parent's digest and the block's token ids; the first block of a salted
chain also commits to the salt, which therefore binds every later block to the namespace.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from native_engine.kvcache.block_hash import DIGEST_SIZE, NONE_HASH, block_hash

MEDIUM_CPU = "CPU"
MEDIUM_DISK = "DISK"


@dataclass(slots=True, eq=False)
class TierEntry:
    """One block in a tier. `namespace` is the cache salt when `attributed` (the block was
    demoted in this process); a disk block found at start-up is unattributed, since salts are
    never written to disk. `hits` and `last_use` feed the value-aware eviction order."""

    digest: bytes
    parent: bytes | None
    token_ids: tuple[int, ...]
    namespace: str | None
    attributed: bool
    nbytes: int
    hits: int = 0
    last_use: int = 0

    def check(self, block_size: int) -> None:
        assert len(self.digest) == DIGEST_SIZE, "digest is not 32 bytes"
        assert self.parent is None or len(self.parent) == DIGEST_SIZE, "parent not 32 bytes"
        assert self.parent != self.digest, "a block is its own parent"
        assert len(self.token_ids) == block_size, "entry is not one full block"
        assert self.nbytes > 0


def first_block_keys(namespace: str | None) -> tuple[Any, ...] | None:
    """vLLM's extra keys for the block at token 0 (the salt), as block_hash takes them."""
    return None if namespace is None else (namespace,)


def is_root_of(entry: TierEntry, namespace: str | None, root: bytes = NONE_HASH) -> bool:
    """Whether a parentless `entry` starts a chain of `namespace` (its digest recomputed with
    the namespace's salt; works for unattributed disk blocks too)."""
    if entry.parent is not None:
        return False
    return block_hash(None, entry.token_ids, first_block_keys(namespace), root=root) \
        == entry.digest


class ChildIndex:
    """parent digest -> digests of resident children (None: chain roots), for one tier.

    Invariant: exactly the tier's entries are indexed, each under its own parent."""

    def __init__(self) -> None:
        self._children: dict[bytes | None, set[bytes]] = {}

    def add(self, entry: TierEntry) -> None:
        self._children.setdefault(entry.parent, set()).add(entry.digest)

    def discard(self, entry: TierEntry) -> None:
        kids = self._children.get(entry.parent)
        if kids is not None:
            kids.discard(entry.digest)
            if not kids:
                del self._children[entry.parent]

    def of(self, parent: bytes | None) -> frozenset[bytes]:
        return frozenset(self._children.get(parent, ()))

    def clear(self) -> None:
        self._children.clear()

    def check(self, entries: Iterable[TierEntry]) -> None:
        want: dict[bytes | None, set[bytes]] = {}
        for entry in entries:
            want.setdefault(entry.parent, set()).add(entry.digest)
        assert want == self._children, "child index drifted"


def tokens_match(entry: TierEntry, parent: bytes | None, token_ids: Sequence[int]) -> bool:
    return entry.parent == parent and entry.token_ids == tuple(token_ids)
