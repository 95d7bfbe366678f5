"""Does a ridden engine isolate tenants' prefix caches? Decisions on probed facts (SEC-16).

Three facts, each from a public surface (adapters/vllm/capabilities.py gathers them):

1. the prefix-cache hash algorithm (`prefix_caching_hash_algo` in `vllm:cache_config_info`):
   only SHA-256 (`sha256`, `sha256_cbor`) is collision-resistant enough that one tenant
   cannot craft a block whose hash equals another's; anything else, or no label, is refused;
2. vLLM's salt validation: an invalid salt (`"a/b"`) must be answered 400 naming
   `cache_salt`; a server that accepts it does not read salts, so does not honour them;
3. where prompt-token details are declared, a positive and a negative cache control: the
   same prompt under one salt hits on its second send, and under a fresh salt does not.

Each function returns the one-line reason for refusing, or None.
"""

from __future__ import annotations

from collections.abc import Sequence

COLLISION_RESISTANT_HASHES = frozenset({"sha256", "sha256_cbor"})
INVALID_PROBE_SALT = "a/b"


def hash_algo_refusal(algos: Sequence[str | None]) -> str | None:
    """Every engine (DP rank) of the server must hash with SHA-256."""
    if not algos or any(a is None for a in algos):
        return ("the upstream does not export prefix_caching_hash_algo in "
                "vllm:cache_config_info, so its prefix-cache hash cannot be checked "
                "(SEC-16: start vLLM with --prefix-caching-hash-algo sha256 or sha256_cbor)")
    weak = sorted({a for a in algos if a is not None and a not in COLLISION_RESISTANT_HASHES})
    if weak:
        return (f"the upstream hashes prefix-cache blocks with {', '.join(weak)}, which is "
                "not collision-resistant (SEC-16: start vLLM with "
                "--prefix-caching-hash-algo sha256 or sha256_cbor)")
    return None


def salt_validation_refusal(status: int, param: str | None, message: str) -> str | None:
    """The answer to a completion carrying `cache_salt = "a/b"`."""
    if status == 400 and (param == "cache_salt" or "cache_salt" in message):
        return None
    return (f"the upstream answered {status} to the invalid cache_salt {INVALID_PROBE_SALT!r} "
            "instead of 400 naming cache_salt: it does not validate, so does not honour, "
            "cache salts (SEC-16)")


def cache_control_refusal(first: int | None, repeat: int | None,
                          fresh_salt: int | None) -> str | None:
    """`cached_tokens` of: a prompt's first send under salt A, its repeat under A, and the
    same prompt under a fresh salt B."""
    if first is None or repeat is None or fresh_salt is None:
        return ("prompt-token details declared but a probe completion carried no "
                "usage.prompt_tokens_details.cached_tokens "
                "(start vLLM with --enable-prompt-tokens-details)")
    if repeat <= 0:
        return ("cache positive control failed: the same prompt under the same salt did not "
                "hit the prefix cache on its second send (is prefix caching on?)")
    if fresh_salt > 0:
        return (f"cache negative control failed: a fresh salt hit {fresh_salt} cached tokens "
                "of another salt's prompt, so the upstream does not honour cache salts "
                "(SEC-16)")
    return None
