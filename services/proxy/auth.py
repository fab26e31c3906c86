"""Optional API keys: ``Authorization: Bearer <key>``; a key may name a tenant and its
``cache_salt``, which the proxy stamps on every request so that tenant's chunk hashes never
meet another's (no shared or probe-able prefixes across tenants).

Key file (JSON): ``{"keys": [{"key": "sk-...", "tenant": "acme", "cache_salt": "..."}]}``.
``cache_salt`` defaults to ``tenant_salt(secret, tenant)``: an HMAC of the tenant's name under
the proxy's ``--salt-secret``, or, without one, under a digest of every key in the file. A salt
a tenant could compute (the old ``tenant:<name>``) would let it rebuild another tenant's chunk
hashes and probe its prefixes; this one needs a secret no tenant holds. Rotating a key without
a ``--salt-secret`` changes every salt once: the tenants' cached KV is recomputed, never mixed.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, Field

from agentserving.core.schemas import TENANT_PATTERN


class KeyEntry(BaseModel):
    key: str = Field(min_length=8)
    tenant: str = Field(pattern=TENANT_PATTERN, description="Its sessions in the kvindex are "
                        "scoped by it (sent as TENANT_HEADER).")
    cache_salt: str | None = None


class KeyFile(BaseModel):
    keys: list[KeyEntry]


@dataclass(frozen=True)
class Principal:
    tenant: str
    cache_salt: str | None


def tenant_salt(secret: bytes, tenant: str) -> str:
    """A tenant's default cache salt: stable for one secret, unguessable without it."""
    return "tenant:" + hmac.new(secret, tenant.encode(), hashlib.sha256).hexdigest()[:32]


def keys_digest(entries: list[KeyEntry]) -> bytes:
    """A secret made of every key in the file (none of which a tenant holds all of)."""
    return hashlib.sha256("\n".join(sorted(e.key for e in entries)).encode()).digest()


class ApiKeys:
    def __init__(self, entries: list[KeyEntry], salt_secret: str | None = None) -> None:
        self._entries = entries
        secret = salt_secret.encode() if salt_secret else keys_digest(entries)
        self._salts = {e.tenant: tenant_salt(secret, e.tenant) for e in entries}

    @classmethod
    def load(cls, path: Path, salt_secret: str | None = None) -> ApiKeys:
        return cls(KeyFile.model_validate(json.loads(path.read_text())).keys, salt_secret)

    def authenticate(self, authorization: str | None) -> Principal | None:
        """The principal for an Authorization header, or None when it names no valid key."""
        if not authorization or not authorization.lower().startswith("bearer "):
            return None
        presented = authorization[7:].strip().encode()
        for entry in self._entries:  # constant-time compare for every key
            if hmac.compare_digest(presented, entry.key.encode()):
                return Principal(entry.tenant, entry.cache_salt or self._salts[entry.tenant])
        return None
