"""Optional API keys: ``Authorization: Bearer <key>``; a key may name a tenant and its
``cache_salt``, which the proxy stamps on every request so that tenant's chunk hashes never
meet another's (no shared or probe-able prefixes across tenants).

Key file (JSON): ``{"keys": [{"key": "sk-...", "tenant": "acme", "cache_salt": "..."}]}``;
``cache_salt`` defaults to a salt derived from the tenant name.
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, Field


class KeyEntry(BaseModel):
    key: str = Field(min_length=8)
    tenant: str = Field(min_length=1)
    cache_salt: str | None = None


class KeyFile(BaseModel):
    keys: list[KeyEntry]


@dataclass(frozen=True)
class Principal:
    tenant: str
    cache_salt: str | None


class ApiKeys:
    def __init__(self, entries: list[KeyEntry]) -> None:
        self._entries = entries

    @classmethod
    def load(cls, path: Path) -> ApiKeys:
        return cls(KeyFile.model_validate(json.loads(path.read_text())).keys)

    def authenticate(self, authorization: str | None) -> Principal | None:
        """The principal for an Authorization header, or None when it names no valid key."""
        if not authorization or not authorization.lower().startswith("bearer "):
            return None
        presented = authorization[7:].strip().encode()
        for entry in self._entries:  # constant-time compare for every key
            if hmac.compare_digest(presented, entry.key.encode()):
                return Principal(entry.tenant, entry.cache_salt or f"tenant:{entry.tenant}")
        return None
