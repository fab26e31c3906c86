"""Whose sessions a call may touch: the tenant named in the ``x-agentserving-tenant`` header.

The proxy authenticates each caller by API key and names the caller's tenant on every session
call it makes; the kvindex itself admits only AgentServing's components (the internal token),
so the header is trusted. A tenant's session ``s1`` is stored as ``<tenant>/s1``: tenant B
asking for ``s1`` reaches ``B/s1``, never ``A/s1``, so B cannot read, fork, overwrite, pin,
close or evict through A's session by guessing its id. A call without the header acts in the
unscoped namespace (a fleet with no tenants), whose ids cannot contain ``/`` and so never
name a scoped session. The store never sees the difference: it keys by the scoped id, and the
answers name sessions the way the caller does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Header

from agentserving.core.schemas import TENANT_HEADER, TENANT_PATTERN, SessionInfo


@dataclass(frozen=True)
class SessionScope:
    tenant: str | None = None

    def key(self, session_id: str) -> str:
        """The store's key of the caller's session ``session_id``."""
        return f"{self.tenant}/{session_id}" if self.tenant else session_id

    def name(self, key: str) -> str:
        """The caller's name of a session the store keys as ``key``."""
        return key.split("/", 1)[1] if self.tenant else key

    def shown(self, info: SessionInfo) -> SessionInfo:
        """A stored session as the caller names it (its own id and its parent's)."""
        return info.model_copy(update={
            "session_id": self.name(info.session_id),
            "parent": self.name(info.parent) if info.parent is not None else None})


def session_scope(tenant: Annotated[str | None, Header(
        alias=TENANT_HEADER, pattern=TENANT_PATTERN,
        description="The tenant the call acts for (the proxy sets it from the caller's API "
                    "key): sessions are scoped by it. Absent: the unscoped namespace."
)] = None) -> SessionScope:
    return SessionScope(tenant)
