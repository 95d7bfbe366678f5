"""Block hashes as vLLM's `sha256_cbor` computes them (docs/reference/vllm-surfaces.md §2.6, §2.7).

`h_i = SHA-256(CBOR_canonical([h_{i-1}, tokens_i, extra_keys_i]))` with `h_{-1} = NONE_HASH`,
the hash of a seed string. With the same seed (vLLM: PYTHONHASHSEED, or newer releases'
fixed "vllm-none-hash") these are the digests a vLLM run with
`--prefix-caching-hash-algo sha256_cbor` produces. On the wire a digest is sent as its low 64
bits (last 8 bytes big-endian, unsigned) or, in bytes mode, whole — the same folding
adapters/vllm/kv_decode.fold_hash applies.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import cbor2

DIGEST_SIZE = 32
U64_MASK = (1 << 64) - 1
DEFAULT_HASH_SEED = "vllm-none-hash"


def sha256_cbor(value: Any) -> bytes:
    """SHA-256 of the canonical CBOR encoding of `value` (tuples encode as arrays)."""
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def none_hash(seed: str = DEFAULT_HASH_SEED) -> bytes:
    """The parent digest of a chain's first block."""
    return sha256_cbor(seed)


NONE_HASH = none_hash()


def block_hash(
    parent: bytes | None,
    token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None,
    *,
    root: bytes = NONE_HASH,
) -> bytes:
    """32-byte digest of one full block; `parent` None means the first block (uses `root`)."""
    if parent is not None and len(parent) != DIGEST_SIZE:
        raise ValueError(f"parent digest has {len(parent)} bytes, expected {DIGEST_SIZE}")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
        raise TypeError("token_ids must be integers")
    return sha256_cbor((root if parent is None else parent, tuple(token_ids), extra_keys))


def chain_digests(
    parent: bytes | None,
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: Sequence[tuple[Any, ...] | None],
    *,
    root: bytes = NONE_HASH,
) -> list[bytes]:
    """Digests of consecutive full blocks after `parent`, one `extra_keys` entry per block."""
    if block_size < 1 or len(token_ids) % block_size:
        raise ValueError(f"{len(token_ids)} tokens are not whole blocks of {block_size}")
    if len(extra_keys) != len(token_ids) // block_size:
        raise ValueError("extra_keys needs one entry per block")
    digests: list[bytes] = []
    for i, keys in enumerate(extra_keys):
        chunk = token_ids[i * block_size : (i + 1) * block_size]
        parent = block_hash(parent, chunk, keys, root=root)
        digests.append(parent)
    return digests


def hash_to_wire(digest: bytes, int_mode: bool = True) -> int | bytes:
    """A digest as vLLM sends it: low 64 bits as an unsigned int, or the raw bytes."""
    if not isinstance(digest, bytes) or not digest:
        raise ValueError("a block digest must be non-empty bytes")
    return int.from_bytes(digest[-8:], "big") if int_mode else digest


def namespace_extra_keys(
    namespace: str | None, first_block: int, num_blocks: int
) -> list[tuple[Any, ...] | None]:
    """Per-block extra keys as vLLM builds them for a salted request: the salt only in the
    block starting at token 0, None elsewhere (no LoRA, no multimodal inputs)."""
    return [
        (namespace,) if namespace is not None and first_block + i == 0 else None
        for i in range(num_blocks)
    ]


def prompt_digests(
    namespace: str | None, token_ids: Sequence[int], block_size: int, *, root: bytes = NONE_HASH
) -> list[bytes]:
    """Digests of every full block of `token_ids` from the start of a sequence."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    whole = len(token_ids) - len(token_ids) % block_size
    keys = namespace_extra_keys(namespace, 0, whole // block_size)
    return chain_digests(None, token_ids[:whole], block_size, keys, root=root)
