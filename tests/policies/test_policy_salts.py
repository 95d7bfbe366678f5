"""Tenant salts (SEC-1), vLLM's salt rule, client salt aliases (SEC-2)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import struct
from types import MappingProxyType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.salts import (
    CLIENT_SALT_KEYS,
    VLLM_SALT_BAD_FORMAT,
    VLLM_SALT_NOT_NONEMPTY,
    SaltKey,
    SaltKeyError,
    find_client_salt_headers,
    find_client_salts,
    framed_salt,
    strip_client_salts,
    tenant_salt,
    validate_vllm_cache_salt,
)

KEY = bytes(range(32))

# Pinned once from the independent construction below (struct + hmac + base64).
KNOWN_ANSWERS = [
    (KEY, "tenant-a", 0, "fak1-5KOnkSD3oPCFDeHhYmEhvJ1ywlAZqLG51h4sHZ86qiI"),
    (KEY, "tenant-a", 1, "fak1-D8nalx0Uxa49VZp5f7vOCIqUOrl_uopkxvnou4k2j7c"),
    (KEY, "org_1", 2345, "fak1-GrN0gycSsqW45DOuaZapKJBlgRUixwXsJqV3TMvQHpE"),
    (KEY, "租户-ü", 7, "fak1-BUktnSTGmjoHLnTucUVUTGaf6KSAflJBWcJR_eKsBuY"),
    (b"\xff" * 64, "acme", 42, "fak1-utpu9nww1Tuw2B86gKZaiFCraJYwYRxKVjr1WAQvrxU"),
]


def independent_salt(key: bytes, tenant: str, epoch: str) -> str:
    fields = [b"cache-salt-v1", tenant.encode("utf-8"), epoch.encode("utf-8")]
    message = b"".join(struct.pack(">I", len(f)) + f for f in fields)
    digest = hmac.new(key, message, hashlib.sha256).digest()
    return "fak1-" + base64.urlsafe_b64encode(digest).decode("ascii").rstrip("=")


@pytest.mark.parametrize(("key", "tenant", "epoch", "expected"), KNOWN_ANSWERS)
def test_known_answer_vectors(key: bytes, tenant: str, epoch: int, expected: str) -> None:
    assert tenant_salt(key, tenant, epoch) == expected
    assert independent_salt(key, tenant, str(epoch)) == expected


def test_framing_separates_field_boundaries() -> None:
    a = framed_salt(KEY, ("cache-salt-v1", "org_1", "2345"))
    b = framed_salt(KEY, ("cache-salt-v1", "org_12345", ""))
    assert a != b
    assert a == tenant_salt(KEY, "org_1", 2345)
    assert b == independent_salt(KEY, "org_12345", "")
    assert b == "fak1-sXB5UFFJcFlqwabFt7mAGCPue96MrLHf94cOarFG3jo"
    # Same unframed concatenation "org_12345", other splits with an int epoch.
    assert len({tenant_salt(KEY, "org_1", 2345), tenant_salt(KEY, "org_123", 45)}) == 2


def test_epoch_change_gives_new_salt() -> None:
    salts = {tenant_salt(KEY, "tenant-a", epoch) for epoch in range(50)}
    assert len(salts) == 50


def test_other_key_gives_other_salt() -> None:
    assert tenant_salt(KEY, "t", 0) != tenant_salt(bytes(32), "t", 0)


def test_salt_is_not_a_public_digest_of_the_tenant() -> None:
    salt = tenant_salt(KEY, "tenant-a", 0)
    body = salt.removeprefix("fak1-")
    for public in (b"tenant-a", b"tenant-a0", b"cache-salt-v1tenant-a0"):
        assert body != base64.urlsafe_b64encode(hashlib.sha256(public).digest()).decode().rstrip(
            "="
        )
        assert body != hashlib.sha256(public).hexdigest()


@pytest.mark.parametrize("key", [None, b"", bytearray(), b"x" * 31, b"\x00" * 16])
def test_missing_or_short_key_is_refused(key: bytes | None) -> None:
    with pytest.raises(SaltKeyError):
        tenant_salt(key, "tenant-a", 0)


def test_key_of_wrong_type_is_refused() -> None:
    with pytest.raises(SaltKeyError):
        tenant_salt("a" * 40, "tenant-a", 0)  # type: ignore[arg-type]
    with pytest.raises(SaltKeyError):
        SaltKey("a" * 40)  # type: ignore[arg-type]


def test_key_repr_hides_the_secret() -> None:
    key = SaltKey(b"S" * 40)
    assert "SSSS" not in repr(key) and "SSSS" not in str(key)
    assert tenant_salt(key, "t", 3) == tenant_salt(b"S" * 40, "t", 3)


@pytest.mark.parametrize("epoch", [-1, 1.0, "1", True, None])
def test_bad_epoch_is_refused(epoch: object) -> None:
    with pytest.raises((TypeError, ValueError)):
        tenant_salt(KEY, "t", epoch)  # type: ignore[arg-type]


@pytest.mark.parametrize("tenant", ["", None, 5])
def test_bad_tenant_is_refused(tenant: object) -> None:
    with pytest.raises(ValueError):
        tenant_salt(KEY, tenant, 0)  # type: ignore[arg-type]


@settings(max_examples=150, deadline=None)
@given(tenant=st.text(min_size=1, max_size=300), epoch=st.integers(0, 2**64))
def test_every_salt_passes_vllm_rule(tenant: str, epoch: int) -> None:
    salt = tenant_salt(KEY, tenant, epoch)
    assert validate_vllm_cache_salt(salt) is None
    assert len(salt) == 48 and salt.startswith("fak1-")
    assert set(salt) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


# Recorded vLLM 0.32.0 answers (vectors/vllm-0.32.0-cpu/http_edge_cases.txt).
@pytest.mark.parametrize(
    ("salt", "message"),
    [
        (None, None),
        ("tenant-a", None),
        ("a" * 128, None),
        (" ", None),
        ("", VLLM_SALT_NOT_NONEMPTY),
        (5, VLLM_SALT_NOT_NONEMPTY),
        (["x"], VLLM_SALT_NOT_NONEMPTY),
        ("a/b", VLLM_SALT_BAD_FORMAT),
        ("a" * 200, VLLM_SALT_BAD_FORMAT),
        ("a" * 129, VLLM_SALT_BAD_FORMAT),
        ("user@org", VLLM_SALT_BAD_FORMAT),
        ("a\\b", VLLM_SALT_BAD_FORMAT),
        ("a\x00b", VLLM_SALT_BAD_FORMAT),
        ("é" * 128, None),
    ],
)
def test_vllm_salt_rule(salt: object, message: str | None) -> None:
    assert validate_vllm_cache_salt(salt) == message


def test_vllm_messages_match_recorded_server() -> None:
    assert VLLM_SALT_NOT_NONEMPTY == (
        "Parameter 'cache_salt' must be a non-empty string if provided. (parameter=cache_salt)"
    )
    # The recorded body carries two backslash characters between the quotes.
    assert "'\\\\'" in VLLM_SALT_BAD_FORMAT
    assert VLLM_SALT_BAD_FORMAT.startswith("Parameter 'cache_salt' must be at most 128 characters")


def test_find_client_salts_top_level_and_nested() -> None:
    body = {
        "model": "m",
        "cache_salt": "A",
        "Salt_Regions": [],
        "cache_salt_map": {},
        "nvext": {"cache_salt": "x", "other": 1},
        "extra_body": {"nvext": {"cache_salt": "y"}, "items": [{"cache_salt_id": 3}]},
        "vllm_xargs": {"extra_key": "k"},
    }
    found = {f.dotted for f in find_client_salts(body)}
    assert found == {
        "cache_salt",
        "Salt_Regions",
        "cache_salt_map",
        "nvext.cache_salt",
        "extra_body.nvext.cache_salt",
        "extra_body.items.0.cache_salt_id",
        "vllm_xargs.extra_key",
    }


def test_find_client_salts_ignores_content_fields() -> None:
    body = {
        "messages": [{"role": "user", "content": "set cache_salt", "cache_salt": "in-message"}],
        "tools": [{"function": {"parameters": {"properties": {"cache_salt": {}}}}}],
        "response_format": {"json_schema": {"schema": {"cache_salt": 1}}},
    }
    assert find_client_salts(body) == ()


def test_find_client_salts_rejects_non_object() -> None:
    with pytest.raises(TypeError):
        find_client_salts(["cache_salt"])  # type: ignore[arg-type]


def test_strip_client_salts_removes_only_aliases() -> None:
    body = {
        "model": "m",
        "cache_salt": "A",
        "nvext": {"cache_salt": "x", "keep": 1},
        "extra_body": {"list": [{"extra_key": 1, "keep": 2}]},
        "messages": [{"role": "user", "content": "hi"}],
    }
    stripped, found = strip_client_salts(body)
    assert stripped == {
        "model": "m",
        "nvext": {"keep": 1},
        "extra_body": {"list": [{"keep": 2}]},
        "messages": [{"role": "user", "content": "hi"}],
    }
    assert len(found) == 3
    assert body["cache_salt"] == "A" and "cache_salt" in body["nvext"]  # input untouched
    assert find_client_salts(stripped) == ()


json_leaf = st.none() | st.booleans() | st.integers() | st.text(max_size=5)
json_value = st.recursive(
    json_leaf,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from([*CLIENT_SALT_KEYS, "nvext", "extra_body", "a", "b"]), inner, max_size=3
        )
    ),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None)
@given(
    body=st.dictionaries(
        st.text(max_size=12) | st.sampled_from(["nvext", "cache_salt"]), json_value, max_size=5
    )
)
def test_strip_leaves_nothing_to_find(body: dict) -> None:
    stripped, found = strip_client_salts(body)
    assert find_client_salts(stripped) == ()
    assert found == find_client_salts(body)


def test_client_salt_headers_case_insensitive() -> None:
    names = ["Authorization", "X-Tenant-Id", "x-cache-salt", "Content-Type"]
    assert find_client_salt_headers(names) == ("X-Tenant-Id", "x-cache-salt")


@settings(max_examples=200, deadline=None)
@given(body=st.dictionaries(
    st.sampled_from(["model", "prompt", "Cache_Salt", "NVEXT", "Extra_Body", "vllm_xargs"])
    | st.text(max_size=12), json_value, max_size=5))
def test_a_dict_body_and_the_same_mapping_read_alike(body: dict) -> None:
    """A dict whose top-level keys name no salt or container is cleared at once; any other
    mapping is always scanned. Both must give the same answer."""
    view = MappingProxyType(body)
    assert strip_client_salts(body) == strip_client_salts(view)
    assert find_client_salts(body) == find_client_salts(view)


def test_a_cleared_body_is_still_a_new_dict() -> None:
    body = {"model": "m", "prompt": "p"}
    stripped, found = strip_client_salts(body)
    assert found == () and stripped == body and stripped is not body
    stripped["cache_salt"] = "x"
    assert "cache_salt" not in body


def test_a_body_with_a_key_that_is_no_string_is_scanned() -> None:
    body = {1: "one", "Cache_Salt": "x"}
    assert [f.dotted for f in find_client_salts(body)] == ["Cache_Salt"]  # type: ignore[arg-type]
    assert strip_client_salts(body)[0] == {1: "one"}  # type: ignore[arg-type]


def test_client_salt_headers_from_a_one_pass_iterable() -> None:
    assert find_client_salt_headers(iter(["Host", "Content-Type"])) == ()
    assert find_client_salt_headers(iter(["Host", "X-KV-Namespace"])) == ("X-KV-Namespace",)
