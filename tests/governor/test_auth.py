from __future__ import annotations

import ast
import inspect

import pytest
from hypothesis import given
from hypothesis import strategies as st

import governor.auth as auth_module
from governor.auth import Authenticator, bearer_token, sha256_hex
from governor.config import TenantConfig


def _tenants() -> tuple[TenantConfig, ...]:
    return (
        TenantConfig(id="a", api_key_sha256=(sha256_hex("key-a"), sha256_hex("key-a2"))),
        TenantConfig(id="b", api_key_sha256=(sha256_hex("key-b"),)),
    )


def test_keys_map_to_tenants() -> None:
    auth = Authenticator(_tenants(), sha256_hex("admin"))
    assert auth.tenant_for("Bearer key-a").id == "a"
    assert auth.tenant_for("bearer key-a2").id == "a"
    assert auth.tenant_for("Bearer key-b").id == "b"
    for bad in (None, "", "Bearer", "Bearer ", "Basic key-a", "key-a", "Bearer key-c"):
        assert auth.tenant_for(bad) is None
    assert auth.is_admin("Bearer admin")
    assert not auth.is_admin("Bearer key-a")
    assert not Authenticator(_tenants(), None).is_admin("Bearer admin")


def test_bearer_parsing() -> None:
    assert bearer_token("Bearer  tok ") == "tok"
    assert bearer_token("Token tok") is None


def test_secrets_compared_in_constant_time_only() -> None:
    """SEC-15: digests meet only in hmac.compare_digest; no ==/!= on them anywhere."""
    tree = ast.parse(inspect.getsource(auth_module))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Attribute) and n.func.attr == "compare_digest"]
    assert len(calls) >= 2
    secret_names = {"presented", "digest", "token", "_admin"}

    def names(node: ast.AST) -> set[str]:
        return {getattr(n, "id", getattr(n, "attr", "")) for n in ast.walk(node)}

    compares = [n for n in ast.walk(tree) if isinstance(n, ast.Compare)
                and any(isinstance(op, ast.Eq | ast.NotEq) for op in n.ops)
                and names(n) & secret_names]
    assert compares == []


def test_a_key_is_found_without_scanning_every_tenant(monkeypatch: pytest.MonkeyPatch) -> None:
    """The admission path costs the same for 2,000 tenants as for one: a presented key's
    digest is looked up, then compared once (SEC-15), never against every tenant's."""
    tenants = tuple(TenantConfig(id=f"t{i}", api_key_sha256=(sha256_hex(f"key-{i}"),))
                    for i in range(2000))
    auth = Authenticator(tenants, None)
    calls = []
    real = auth_module.hmac.compare_digest

    def counted(a: bytes, b: bytes) -> bool:
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(auth_module.hmac, "compare_digest", counted)
    for i in (0, 777, 1999):
        calls.clear()
        tenant = auth.tenant_for(f"Bearer key-{i}")
        assert tenant is not None and tenant.id == f"t{i}"
        assert len(calls) == 1
    calls.clear()
    assert auth.tenant_for("Bearer key-2000") is None
    assert len(calls) <= 1


@given(st.lists(st.text(min_size=1, max_size=40).map(str.strip).filter(bool),
                min_size=1, max_size=20, unique=True), st.text(max_size=40))
def test_every_key_maps_to_its_own_tenant(keys: list[str], other: str) -> None:
    tenants = tuple(TenantConfig(id=f"t{i}", api_key_sha256=(sha256_hex(k),))
                    for i, k in enumerate(keys))
    auth = Authenticator(tenants, None)
    for i, key in enumerate(keys):
        found = auth.tenant_for(f"Bearer {key}")
        assert found is not None and found.id == f"t{i}"
    token = other.strip()
    if token and token not in keys and " " not in token:
        assert auth.tenant_for(f"Bearer {other}") is None
