"""RFC 9162 Merkle tree: published vectors, round-trip properties, tamper rejection."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings

from governor.audit import merkle

# RFC 6962 / certificate-transparency reference inputs, roots, and proofs.
CT_INPUTS = [
    bytes.fromhex(h)
    for h in ("", "00", "10", "2021", "3031", "40414243", "5051525354555657",
              "606162636465666768696a6b6c6d6e6f")
]
CT_LEAVES = [merkle.leaf_hash(d) for d in CT_INPUTS]
CT_ROOTS = [
    "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
    "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
    "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77",
    "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    "4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4",
    "76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef",
    "ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c",
    "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328",
]
CT_INCLUSION = [  # (0-based index, tree size, proof)
    (0, 8, ["96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4"]),
    (5, 8, ["bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
            "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
            "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7"]),
    (2, 3, ["fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125"]),
    (1, 5, ["6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b"]),
]
CT_CONSISTENCY = [  # (old size, new size, proof)
    (1, 1, []),
    (1, 8, ["96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4"]),
    (6, 8, ["0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a",
            "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
            "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7"]),
    (2, 5, ["5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b"]),
]


def _hex(hashes: list[bytes]) -> list[str]:
    return [h.hex() for h in hashes]


def test_roots_match_rfc6962_for_sizes_0_to_8() -> None:
    for n in range(9):
        assert merkle.root(CT_LEAVES[:n]).hex() == CT_ROOTS[n], n


def test_inclusion_vectors() -> None:
    for index, size, expected in CT_INCLUSION:
        proof = merkle.inclusion_proof(CT_LEAVES[:size], index)
        assert _hex(proof) == expected
        root = bytes.fromhex(CT_ROOTS[size])
        assert merkle.verify_inclusion(CT_LEAVES[index], index, size, proof, root)
        assert not merkle.verify_inclusion(CT_LEAVES[index], index, size, proof, merkle.EMPTY_ROOT)


def test_consistency_vectors() -> None:
    for old, new, expected in CT_CONSISTENCY:
        proof = merkle.consistency_proof(CT_LEAVES[:new], old)
        assert _hex(proof) == expected
        assert merkle.verify_consistency(
            old, new, bytes.fromhex(CT_ROOTS[old]), bytes.fromhex(CT_ROOTS[new]), proof
        )


def test_bad_arguments_are_refused() -> None:
    import pytest

    with pytest.raises(ValueError):
        merkle.inclusion_proof(CT_LEAVES[:3], 3)
    with pytest.raises(ValueError):
        merkle.consistency_proof(CT_LEAVES[:3], 4)
    root3 = merkle.root(CT_LEAVES[:3])
    assert not merkle.verify_inclusion(CT_LEAVES[0], 3, 3, [], root3)
    assert not merkle.verify_consistency(4, 3, root3, root3, [])
    assert not merkle.verify_consistency(2, 3, root3, root3, [])  # a real step needs a proof
    assert merkle.verify_consistency(0, 3, merkle.EMPTY_ROOT, root3, [])


def _flip(h: bytes, bit: int) -> bytes:
    return bytes([h[0] ^ (1 << (bit % 8))]) + h[1:]


leaf_lists = st.lists(st.binary(max_size=12), min_size=1, max_size=70).map(
    lambda datas: [merkle.leaf_hash(d) for d in datas]
)


@settings(max_examples=80, deadline=None)
@given(leaves=leaf_lists, data=st.data())
def test_every_inclusion_proof_verifies_and_tampering_fails(leaves: list[bytes], data) -> None:
    n = len(leaves)
    root = merkle.root(leaves)
    index = data.draw(st.integers(0, n - 1))
    proof = merkle.inclusion_proof(leaves, index)
    assert merkle.verify_inclusion(leaves[index], index, n, proof, root)
    bit = data.draw(st.integers(0, 7))
    assert not merkle.verify_inclusion(_flip(leaves[index], bit), index, n, proof, root)
    assert not merkle.verify_inclusion(leaves[index], index, n, proof, _flip(root, bit))
    if proof:
        k = data.draw(st.integers(0, len(proof) - 1))
        bad = [*proof[:k], _flip(proof[k], bit), *proof[k + 1:]]
        assert not merkle.verify_inclusion(leaves[index], index, n, bad, root)
        assert not merkle.verify_inclusion(leaves[index], index, n, proof[:-1], root)
    if n > 1:
        other = (index + 1) % n
        if leaves[other] != leaves[index]:
            assert not merkle.verify_inclusion(leaves[other], index, n, proof, root)


@settings(max_examples=80, deadline=None)
@given(leaves=leaf_lists, data=st.data())
def test_every_consistency_proof_verifies_and_tampering_fails(leaves: list[bytes], data) -> None:
    n = len(leaves)
    m = data.draw(st.integers(0, n))
    old_root, new_root = merkle.root(leaves[:m]), merkle.root(leaves)
    proof = merkle.consistency_proof(leaves, m)
    assert merkle.verify_consistency(m, n, old_root, new_root, proof)
    if 0 < m < n:
        bit = data.draw(st.integers(0, 7))
        assert not merkle.verify_consistency(m, n, _flip(old_root, bit), new_root, proof)
        assert not merkle.verify_consistency(m, n, old_root, _flip(new_root, bit), proof)
        k = data.draw(st.integers(0, len(proof) - 1))
        bad = [*proof[:k], _flip(proof[k], bit), *proof[k + 1:]]
        assert not merkle.verify_consistency(m, n, old_root, new_root, bad)
        # A different history of the first m leaves (a rollback) is not a prefix.
        rewritten = [merkle.leaf_hash(b"forged"), *leaves[1:]]
        if rewritten[0] != leaves[0]:
            forged_new = merkle.root(rewritten)
            forged_proof = merkle.consistency_proof(rewritten, m)
            assert not merkle.verify_consistency(m, n, old_root, forged_new, forged_proof)


@settings(max_examples=60, deadline=None)
@given(leaves=leaf_lists)
def test_frontier_matches_recursive_definition(leaves: list[bytes]) -> None:
    frontier = merkle.Frontier()
    for i, h in enumerate(leaves):
        frontier.append(h)
        frontier.check_integrity()
        assert frontier.root() == _mth(leaves[: i + 1])


def _mth(hashes: list[bytes]) -> bytes:
    """The RFC's recursive MTH, written independently of the frontier."""
    if not hashes:
        return merkle.EMPTY_ROOT
    if len(hashes) == 1:
        return hashes[0]
    k = 1
    while k * 2 < len(hashes):
        k *= 2
    return merkle.node_hash(_mth(hashes[:k]), _mth(hashes[k:]))
