"""Bearer-token authentication by digest, compared in constant time (SEC-15)."""

from __future__ import annotations

import hashlib
import hmac

from governor.config import TenantConfig


def sha256_hex(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def bearer_token(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


class Authenticator:
    """Maps an API key to its tenant. Every digest is compared, so timing does not say which."""

    def __init__(self, tenants: tuple[TenantConfig, ...], admin_token_sha256: str | None) -> None:
        self._entries = [(bytes.fromhex(d), t) for t in tenants for d in t.api_key_sha256]
        self._admin = bytes.fromhex(admin_token_sha256) if admin_token_sha256 else None

    def tenant_for(self, header: str | None) -> TenantConfig | None:
        token = bearer_token(header)
        if token is None:
            return None
        presented = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        found = None
        for digest, tenant in self._entries:
            if hmac.compare_digest(presented, digest):
                found = tenant
        return found

    def is_admin(self, header: str | None) -> bool:
        token = bearer_token(header)
        if token is None or self._admin is None:
            return False
        presented = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        return hmac.compare_digest(presented, self._admin)
