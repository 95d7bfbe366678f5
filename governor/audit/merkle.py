"""RFC 9162 §2.1 Merkle tree hashing, inclusion and consistency proofs (SHA-256).

leaf = SHA-256(0x00 ‖ data), node = SHA-256(0x01 ‖ left ‖ right); the empty tree hashes to
SHA-256(""). A tree of n leaves splits at k, the largest power of two below n, so an odd
node is promoted, never duplicated. Proof generation takes the list of leaf hashes and costs
O(n) hashing; verification takes only sizes, hashes and the proof, O(log n).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

HASH_SIZE = 32
EMPTY_ROOT = hashlib.sha256(b"").digest()


def leaf_hash(data: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + data).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def _split(n: int) -> int:
    """Largest power of two strictly below n (n ≥ 2)."""
    return 1 << ((n - 1).bit_length() - 1)


def root(leaf_hashes: Sequence[bytes]) -> bytes:
    """MTH over leaf hashes (already `leaf_hash`ed)."""
    frontier = Frontier()
    for h in leaf_hashes:
        frontier.append(h)
    return frontier.root()


def inclusion_proof(leaf_hashes: Sequence[bytes], index: int) -> list[bytes]:
    """PATH(index, D[n]) for n = len(leaf_hashes)."""
    if not 0 <= index < len(leaf_hashes):
        raise ValueError(f"leaf index {index} outside tree of size {len(leaf_hashes)}")
    return _path(leaf_hashes, index)


def _path(hashes: Sequence[bytes], m: int) -> list[bytes]:
    n = len(hashes)
    if n == 1:
        return []
    k = _split(n)
    if m < k:
        return [*_path(hashes[:k], m), root(hashes[k:])]
    return [*_path(hashes[k:], m - k), root(hashes[:k])]


def consistency_proof(leaf_hashes: Sequence[bytes], old_size: int) -> list[bytes]:
    """PROOF(old_size, D[n]); empty when old_size is 0 or n (nothing to prove)."""
    n = len(leaf_hashes)
    if not 0 <= old_size <= n:
        raise ValueError(f"old size {old_size} outside 0..{n}")
    if old_size in (0, n):
        return []
    return _subproof(leaf_hashes, old_size, True)


def _subproof(hashes: Sequence[bytes], m: int, complete: bool) -> list[bytes]:
    n = len(hashes)
    if m == n:
        return [] if complete else [root(hashes)]
    k = _split(n)
    if m <= k:
        return [*_subproof(hashes[:k], m, complete), root(hashes[k:])]
    return [*_subproof(hashes[k:], m - k, False), root(hashes[:k])]


def verify_inclusion(
    leaf: bytes, index: int, tree_size: int, proof: Sequence[bytes], root_hash: bytes
) -> bool:
    """RFC 9162 §2.1.3.2. `leaf` is the leaf hash."""
    if not 0 <= index < tree_size:
        return False
    fn, sn, r = index, tree_size - 1, leaf
    for p in proof:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            r = node_hash(r, p)
        fn >>= 1
        sn >>= 1
    return sn == 0 and r == root_hash


def verify_consistency(
    old_size: int, new_size: int, old_root: bytes, new_root: bytes, proof: Sequence[bytes]
) -> bool:
    """RFC 9162 §2.1.4.2, plus the trivial cases: size 0 is a prefix of anything; equal
    sizes need an empty proof and equal roots."""
    if not 0 <= old_size <= new_size:
        return False
    if old_size == 0:
        return not proof
    if old_size == new_size:
        return not proof and old_root == new_root
    if not proof:
        return False
    path = list(proof)
    if old_size & (old_size - 1) == 0:
        path.insert(0, old_root)
    fn, sn = old_size - 1, new_size - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            fr = node_hash(c, fr)
            sr = node_hash(c, sr)
            while not fn & 1 and fn != 0:
                fn >>= 1
                sn >>= 1
        else:
            sr = node_hash(sr, c)
        fn >>= 1
        sn >>= 1
    return fr == old_root and sr == new_root and sn == 0


class Frontier:
    """Incremental MTH: the roots of the perfect subtrees covering the leaves so far.

    Invariant: heights strictly decrease along the stack and equal the set bits of `size`,
    so `root()` folds them right to left exactly as RFC 9162's left-heavy split does.
    """

    __slots__ = ("_stack", "size")

    def __init__(self) -> None:
        self._stack: list[tuple[int, bytes]] = []
        self.size = 0

    def append(self, leaf: bytes) -> None:
        height, h = 0, leaf
        while self._stack and self._stack[-1][0] == height:
            _, left = self._stack.pop()
            h = node_hash(left, h)
            height += 1
        self._stack.append((height, h))
        self.size += 1

    def copy(self) -> Frontier:
        twin = Frontier()
        twin._stack, twin.size = list(self._stack), self.size
        return twin

    def to_hex(self) -> list[str]:
        """The subtree roots, left to right, as hex (their heights follow from `size`)."""
        return [h.hex() for _, h in self._stack]

    @classmethod
    def from_hex(cls, size: int, roots: Sequence[str]) -> Frontier:
        """Inverse of `to_hex`; refuses a stack that does not match `size`."""
        heights = [b for b in range(size.bit_length() - 1, -1, -1) if size >> b & 1]
        if size < 0 or len(heights) != len(roots):
            raise ValueError(f"{len(roots)} subtree roots cannot cover {size} leaves")
        frontier = cls()
        frontier._stack = [(height, bytes.fromhex(h)) for height, h in zip(heights, roots,
                                                                             strict=True)]
        frontier.size = size
        return frontier

    def root(self) -> bytes:
        if not self._stack:
            return EMPTY_ROOT
        r = self._stack[-1][1]
        for _, h in reversed(self._stack[:-1]):
            r = node_hash(h, r)
        return r

    def check_integrity(self) -> None:
        heights = [height for height, _ in self._stack]
        expected = [b for b in range(self.size.bit_length() - 1, -1, -1) if self.size >> b & 1]
        if heights != expected:
            raise AssertionError(f"frontier heights {heights} do not match size {self.size}")
