from __future__ import annotations

import ast
import inspect

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
