"""What one engine rank holds in its prefix cache, rebuilt from KV events (docs/design.md §5).

Each resident block hash maps to its parent, its namespace (the `cache_salt` read from block
0's `extra_keys`, inherited down the parent chain; later blocks' entries, null or not, never
carry a salt), the media it sits on and its block size. Token ids are never kept, and a
namespace is kept only as `namespace_digest(key, salt)` — an HMAC under a key derived from
the governor's salt key (random per index when none is given) — never as the salt (SEC-17).
Lookups take the salt and digest it.

The index is bounded (SEC-17): it holds at most `capacity` blocks — the engine's own block
count for the rank — since a correct stream can never describe more. A store beyond that is
dropped and counted in `overflow_drops`; whoever follows the stream must then treat the rank
as UNCERTAIN (the index no longer mirrors the engine). `clear()` resets the count.

For routing (policies/routing.py), each block whose tokens the event carried also gets a
chain key: `blake2b(parent's chain key ‖ its tokens)`, the root's parent being its
namespace digest — so a chain key names a token prefix inside one namespace, and another
tenant's blocks can never match it. `prefix_blocks(salt, tokens, block_size)` counts how
many leading full blocks of a prompt the rank holds in the prompt's own namespace. Only the
keys are kept, never the tokens.

A namespace is `certain` only when it was read from a root block's `extra_keys` or inherited
from a resident parent whose namespace was certain; a block stored under an unknown parent,
or whose root keys cannot be attributed, is kept but marked uncertain (oracle §2.9 case 4).
A medium of None (S1 events) counts as "GPU".

Invariants (`check_integrity`): every block has at least one medium; `_by_namespace` holds
exactly the certain blocks, each under its own namespace; `_uncertain` holds exactly the
uncertain ones; no block is its own parent; at most `capacity` blocks.
"""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from policies.salts import namespace_digest
from schemas.kv_events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEvent

log = logging.getLogger(__name__)

DEFAULT_MEDIUM = "GPU"
DEFAULT_CAPACITY = 1 << 18  # blocks, until the engine's own block count is known
_MM_HASH = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """One resident block; `namespace` is the digest of its salt (None: no salt)."""

    block_hash: int
    parent: int | None
    namespace: str | None
    namespace_certain: bool
    block_size: int
    media: frozenset[str] = field(default_factory=frozenset)
    chain: bytes | None = None


@dataclass(frozen=True, slots=True)
class Attribution:
    namespace: str | None
    certain: bool


def salt_from_root_keys(keys: Any, lora_name: str | None) -> Attribution:
    """The cache salt in block 0's extra keys (docs/reference/vllm-surfaces.md §2.7).

    vLLM concatenates LoRA name + multimodal ids + salt + prompt-embeds digest. Typed keys
    (`{"type": "cache_salt", "salt": s}` or `("cache_salt", s)`) are read directly; otherwise
    the LoRA name, tuples, 64-hex multimodal hashes and non-strings are dropped and exactly
    one remaining string is the salt. More than one leaves the namespace uncertain.
    """
    if keys is None:
        return Attribution(None, True)
    if not isinstance(keys, tuple | list):
        return Attribution(None, False)
    candidates: list[str] = []
    lora_skipped = False
    for key in keys:
        if (
            isinstance(key, dict)
            and key.get("type") == "cache_salt"
            and isinstance(key.get("salt"), str)
        ):
            return Attribution(key["salt"], True)
        if isinstance(key, tuple | list) and len(key) == 2 and key[0] == "cache_salt":
            return Attribution(str(key[1]), True)
        if not isinstance(key, str) or _MM_HASH.fullmatch(key):
            continue
        if key == lora_name and not lora_skipped:
            lora_skipped = True
            continue
        candidates.append(key)
    if len(candidates) > 1:
        return Attribution(None, False)
    return Attribution(candidates[0] if candidates else None, True)


def chain_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a block holding `tokens` after the block (or namespace root) `parent`."""
    return _block_key(parent, array("I", tokens).tobytes())


def _block_key(parent: bytes, packed: bytes) -> bytes:
    """`chain_key` of a block whose token ids are already packed as uint32."""
    return hashlib.blake2b(parent + packed, digest_size=16).digest()


def namespace_root(namespace: str | None) -> bytes:
    """The chain's starting point in a namespace (digest; None: the unsalted namespace)."""
    return b"\x00" if namespace is None else b"\x01" + namespace.encode()


def prompt_chain(namespace: str | None, tokens: Sequence[int], block_size: int,
                 head: Sequence[bytes] = ()) -> list[bytes]:
    """Chain keys of a prompt's full blocks, in order (`chain_key` of each block, on one
    packing of the prompt: the routing decision's hot path). `head`: the keys of its first
    blocks where already known (from an earlier prompt with the same leading tokens); only
    the blocks past them are hashed."""
    keys = list(head)
    key = keys[-1] if keys else namespace_root(namespace)
    data, step = array("I", tokens[len(keys) * block_size:]).tobytes(), 4 * block_size
    for start in range(0, len(data) - step + 1, step):
        key = _block_key(key, data[start:start + step])
        keys.append(key)
    return keys


class ShadowIndex:
    """Block hash → BlockInfo for one engine rank. Not thread-safe; one event loop owns it."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY,
                 namespace_key: bytes | None = None) -> None:
        self.set_capacity(capacity)
        self._key = namespace_key if namespace_key is not None else secrets.token_bytes(32)
        namespace_digest(self._key, "")  # checks the key once
        # Which key names namespaces here, as a one-way fingerprint: indexes with the same
        # one name a salt alike, so a routing decision computes the digest once for them.
        self.keying = hashlib.blake2b(self._key, digest_size=16, person=b"fak-ns-keying").digest()
        self._blocks: dict[int, BlockInfo] = {}
        self._by_namespace: dict[str | None, set[int]] = {}
        self._uncertain: set[int] = set()
        self._by_chain: dict[bytes, int] = {}
        self.anomalies = 0
        self.overflow_drops = 0

    def set_capacity(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
        self.capacity = capacity

    def namespace_id(self, salt: str | None) -> str | None:
        """How this index names the namespace of `salt` (None stays None). Not memoised:
        the index never holds a salt (SEC-17)."""
        return None if salt is None else namespace_digest(self._key, salt)

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, block_hash: int) -> BlockInfo | None:
        return self._blocks.get(block_hash)

    def resident(self, salt: str | None) -> frozenset[int]:
        """Blocks certainly in the namespace of `salt` (None = requests without a salt)."""
        return frozenset(self._by_namespace.get(self.namespace_id(salt), ()))

    def uncertain(self) -> frozenset[int]:
        return frozenset(self._uncertain)

    def namespaces(self) -> dict[str | None, int]:
        """Blocks per namespace digest (None: unsalted)."""
        return {ns: len(hashes) for ns, hashes in self._by_namespace.items() if hashes}

    def may_hold(self, namespace: str | None) -> bool:
        """Whether a prompt's chain in `namespace` (a digest, as `namespace_id` gives) could
        match here at all: every block with a chain key of that namespace is a certain
        block of it, or an uncertain one."""
        return bool(self._by_namespace.get(namespace)) or bool(self._uncertain)

    def all_blocks(self) -> frozenset[int]:
        return frozenset(self._blocks)

    def prefix_blocks(self, salt: str | None, tokens: Sequence[int], block_size: int) -> int:
        """Leading full blocks of `tokens` resident here in the namespace of `salt`."""
        return self.matched_blocks(prompt_chain(self.namespace_id(salt), tokens, block_size))

    def matched_blocks(self, chain: Sequence[bytes]) -> int:
        """How many leading keys of a prompt's chain are resident."""
        for count, key in enumerate(chain):
            if key not in self._by_chain:
                return count
        return len(chain)

    def apply(self, event: KVEvent) -> None:
        if isinstance(event, BlockStored):
            self._store(event)
        elif isinstance(event, BlockRemoved):
            self._remove(event)
        elif isinstance(event, AllBlocksCleared):
            self.clear(event.medium)

    def clear(self, medium: str | None = None) -> None:
        """Drop every block (medium None) or only one medium's copies."""
        if medium is None:
            self._blocks.clear()
            self._by_namespace.clear()
            self._uncertain.clear()
            self._by_chain.clear()
            self.overflow_drops = 0
            return
        for block_hash in list(self._blocks):
            self._drop_medium(block_hash, medium)

    def _root_attribution(self, event: BlockStored) -> Attribution:
        if event.parent_block_hash is not None:
            parent = self._blocks.get(_uint64(event.parent_block_hash))
            if parent is None:
                return Attribution(None, False)
            return Attribution(parent.namespace, parent.namespace_certain)
        if event.extra_keys is None:  # S1/S2 carry no extra keys: the salt is unknowable
            return Attribution(None, False)
        found = salt_from_root_keys(
            event.extra_keys[0] if event.extra_keys else None, event.lora_name
        )
        return Attribution(self.namespace_id(found.namespace), found.certain)

    def _store(self, event: BlockStored) -> None:
        if len(set(event.block_hashes)) != len(event.block_hashes):
            self.anomalies += 1
            log.warning("BlockStored repeats a hash inside one event; ignored (oracle case 8)")
            return
        attribution = self._root_attribution(event)
        medium = event.medium or DEFAULT_MEDIUM
        parent = None if event.parent_block_hash is None else _uint64(event.parent_block_hash)
        chains = self._chains(event, attribution)
        for i, block_hash in enumerate(map(_uint64, event.block_hashes)):
            self._add(block_hash, parent, attribution, event.block_size, medium, chains[i])
            parent = block_hash

    def _chains(self, event: BlockStored, attribution: Attribution) -> list[bytes | None]:
        """The stored blocks' chain keys; None where the tokens or the parent's key are
        unknown (or the namespace is uncertain)."""
        size, count = event.block_size, len(event.block_hashes)
        if not attribution.certain or size < 1 or len(event.token_ids) != size * count:
            return [None] * count
        if event.parent_block_hash is None:
            key: bytes | None = namespace_root(attribution.namespace)
        else:
            parent = self._blocks.get(_uint64(event.parent_block_hash))
            key = None if parent is None else parent.chain
        chains: list[bytes | None] = []
        for i in range(count):
            key = None if key is None else chain_key(key, event.token_ids[i * size:(i + 1) * size])
            chains.append(key)
        return chains

    def _add(
        self, block_hash: int, parent: int | None, attribution: Attribution, size: int,
        medium: str, chain: bytes | None = None,
    ) -> None:
        if parent == block_hash:
            self.anomalies += 1
            return
        known = self._blocks.get(block_hash)
        if known is None and len(self._blocks) >= self.capacity:
            self.overflow_drops += 1
            return
        if known is None:
            info = BlockInfo(
                block_hash,
                parent,
                attribution.namespace,
                attribution.certain,
                size,
                frozenset({medium}),
                chain,
            )
        else:
            info = replace(known, media=known.media | {medium})
            if (
                attribution.certain
                and known.namespace_certain
                and attribution.namespace != known.namespace
            ):
                self.anomalies += (
                    1  # a hash embeds its salt, so this means our attribution is wrong
                )
                info = replace(info, namespace=None, namespace_certain=False, chain=None)
            elif info.chain is None and attribution.certain:
                info = replace(info, chain=chain)
            self._unfile(known)
        self._blocks[block_hash] = info
        self._file(info)

    def _remove(self, event: BlockRemoved) -> None:
        for block_hash in map(_uint64, event.block_hashes):
            self._drop_medium(block_hash, event.medium or DEFAULT_MEDIUM)

    def _drop_medium(self, block_hash: int, medium: str) -> None:
        known = self._blocks.get(block_hash)
        if known is None or medium not in known.media:
            return  # unseen hash: no-op (oracle case 9)
        self._unfile(known)
        remaining = known.media - {medium}
        if remaining:
            self._blocks[block_hash] = replace(known, media=remaining)
            self._file(self._blocks[block_hash])
        else:
            del self._blocks[block_hash]

    def _file(self, info: BlockInfo) -> None:
        if info.namespace_certain:
            self._by_namespace.setdefault(info.namespace, set()).add(info.block_hash)
            if info.chain is not None:
                self._by_chain[info.chain] = info.block_hash
        else:
            self._uncertain.add(info.block_hash)

    def _unfile(self, info: BlockInfo) -> None:
        if info.namespace_certain:
            self._by_namespace.get(info.namespace, set()).discard(info.block_hash)
            if info.chain is not None and self._by_chain.get(info.chain) == info.block_hash:
                del self._by_chain[info.chain]
        else:
            self._uncertain.discard(info.block_hash)

    def check_integrity(self) -> None:
        """Raise AssertionError when an invariant in the module docstring does not hold."""
        filed: set[int] = set()
        for namespace, hashes in self._by_namespace.items():
            for block_hash in hashes:
                info = self._blocks.get(block_hash)
                assert info is not None, f"namespace {namespace!r} files unknown block {block_hash}"
                assert info.namespace_certain and info.namespace == namespace, (
                    f"block {block_hash} misfiled"
                )
                assert block_hash not in filed, f"block {block_hash} filed twice"
                filed.add(block_hash)
        for block_hash in self._uncertain:
            info = self._blocks.get(block_hash)
            assert info is not None and not info.namespace_certain, (
                f"uncertain set wrong at {block_hash}"
            )
        assert filed | self._uncertain == set(self._blocks), "blocks not partitioned by namespace"
        assert not filed & self._uncertain, "block both certain and uncertain"
        for block_hash, info in self._blocks.items():
            assert info.block_hash == block_hash and info.media, f"block {block_hash} has no medium"
            assert info.parent != block_hash, f"block {block_hash} is its own parent"
        assert len(self._blocks) <= self.capacity, "index over its capacity"
        for key, block_hash in self._by_chain.items():
            info = self._blocks.get(block_hash)
            assert info is not None and info.chain == key and info.namespace_certain, (
                f"chain key of {block_hash} stale")


def _uint64(block_hash: BlockHash) -> int:
    """A subscriber's events are normalised (the decoder folds bytes to uint64)."""
    if not isinstance(block_hash, int):
        raise TypeError(f"un-normalised block hash {block_hash!r} reached the shadow index")
    return block_hash
