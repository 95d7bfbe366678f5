"""The native engine's own view of its cache as KV-event hashes (to compare with a subscriber)."""

from __future__ import annotations

from native_engine.engine import LLMEngine
from native_engine.kvcache.block_hash import hash_to_wire
from native_engine.kvcache.events import KVEventRecorder
from native_engine.kvcache.radix_cache import Node, chain_hashes


def resident_block_hashes(engine: LLMEngine, int_mode: bool = True
                          ) -> dict[str | None, set[int | bytes]]:
    """Every full block in the radix cache, by namespace, as the hash its KV events carry.
    Raises AssertionError if a block has no recorded digest."""
    recorder = engine.listener
    if engine.cache is None or not isinstance(recorder, KVEventRecorder):
        return {}
    out: dict[str | None, set[int | bytes]] = {}
    for ns in engine.cache.namespaces:
        ids: set[int] = set()
        for path in _leaf_paths(engine.cache.nodes(ns)):
            ids.update(chain_hashes(ns, path, engine.cache.block_size))
        digests = {cid: recorder.digest_of(cid) for cid in ids}
        missing = [cid for cid, d in digests.items() if d is None]
        assert not missing, f"{len(missing)} cached blocks were never published as stored"
        out[ns] = {hash_to_wire(d, int_mode) for d in digests.values() if d is not None}
    return out


def _leaf_paths(nodes: list[Node]) -> list[list[int]]:
    """Token paths from the namespace root to every leaf."""
    paths: list[list[int]] = []
    stack = [(n, list(n.tokens)) for n in nodes if n.parent is not None and n.parent.parent is None]
    while stack:
        node, path = stack.pop()
        if not node.children:
            paths.append(path)
        stack.extend((c, path + c.tokens) for c in node.children.values())
    return paths
