"""Bearer-token authentication by digest, compared in constant time (SEC-15).

A presented key is hashed, and its SHA-256 digest finds the tenant in a dict: one lookup
however many tenants there are (a scan of every digest cost ~0.1 µs a tenant on each
request). The lookup's timing depends only on the presented key's digest (and the
process's random hash seed), never on how many characters of a real key it shares, and a
stored digest learnt would still need a preimage. The digest found is compared with
`hmac.compare_digest` as every secret here is.
"""

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
    """Maps an API key to its tenant (the config refuses a digest listed twice)."""

    def __init__(self, tenants: tuple[TenantConfig, ...], admin_token_sha256: str | None) -> None:
        self._by_digest = {(digest := bytes.fromhex(d)): (digest, t)
                           for t in tenants for d in t.api_key_sha256}
        self._admin = bytes.fromhex(admin_token_sha256) if admin_token_sha256 else None

    def tenant_for(self, header: str | None) -> TenantConfig | None:
        token = bearer_token(header)
        if token is None:
            return None
        presented = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        entry = self._by_digest.get(presented)
        if entry is None or not hmac.compare_digest(presented, entry[0]):
            return None
        return entry[1]

    def is_admin(self, header: str | None) -> bool:
        token = bearer_token(header)
        if token is None or self._admin is None:
            return False
        presented = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        return hmac.compare_digest(presented, self._admin)
