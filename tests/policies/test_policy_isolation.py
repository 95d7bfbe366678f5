"""policies/isolation.py (SEC-16) and the KV namespace digests of policies/salts.py (SEC-17)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.isolation import cache_control_refusal, hash_algo_refusal, salt_validation_refusal
from policies.salts import SaltKey, SaltKeyError, kv_namespace_key, namespace_digest, tenant_salt


def test_only_sha256_hashes_pass_on_every_engine() -> None:
    assert hash_algo_refusal(["sha256"]) is None
    assert hash_algo_refusal(["sha256_cbor", "sha256"]) is None
    assert "xxhash" in (hash_algo_refusal(["sha256_cbor", "xxhash"]) or "")
    assert "does not export" in (hash_algo_refusal([]) or "")
    assert "does not export" in (hash_algo_refusal(["sha256", None]) or "")


def test_salt_validation_must_name_cache_salt() -> None:
    assert salt_validation_refusal(400, "cache_salt", "") is None
    assert salt_validation_refusal(400, None, "Parameter 'cache_salt' must be ...") is None
    assert salt_validation_refusal(200, None, "") is not None
    assert salt_validation_refusal(400, "model", "bad model") is not None


def test_cache_controls() -> None:
    assert cache_control_refusal(0, 96, 0) is None
    assert "positive control" in (cache_control_refusal(0, 0, 0) or "")
    assert "negative control" in (cache_control_refusal(0, 96, 96) or "")
    assert "enable-prompt-tokens-details" in (cache_control_refusal(None, 96, 0) or "")


def test_namespace_digest_is_keyed_deterministic_and_never_the_salt() -> None:
    key = kv_namespace_key(SaltKey(b"k" * 32))
    salt = tenant_salt(SaltKey(b"k" * 32), "acme", 0)
    digest = namespace_digest(key, salt)
    assert digest == namespace_digest(key, salt) and digest.startswith("ns1-")
    assert salt not in digest and digest != salt
    assert namespace_digest(kv_namespace_key(SaltKey(b"j" * 32)), salt) != digest
    assert key != SaltKey(b"k" * 32).secret  # a derived key, not the salt key
    with pytest.raises(SaltKeyError):
        namespace_digest(b"short", salt)


@given(st.text(min_size=1, max_size=64), st.text(min_size=1, max_size=64))
def test_distinct_salts_get_distinct_digests(a: str, b: str) -> None:
    key = kv_namespace_key(SaltKey(b"k" * 32))
    assert (namespace_digest(key, a) == namespace_digest(key, b)) == (a == b)
