"""A shared secret between AgentServing's own components, so that only they reach the kvindex
and the pods' memory APIs: a tenant that reaches a pod's network cannot read,
fork or evict another's sessions or chunks by calling them directly.

One token for a deployment, given to every process as ``AGENTSERVING_INTERNAL_TOKEN`` (every
command's ``--internal-token`` reads it; child processes inherit it, so a worker's engine
processes and a vLLM pod's ranks have it too). Servers answer a protected path with 401 when
the ``Authorization: Bearer`` header is missing and 403 when it names another token; clients
send it on every call. Health, readiness, metrics and the API docs stay open: kubelets and
Prometheus probe them without credentials. No token configured: nothing is checked (a
single-user fleet on loopback), exactly as before.

This module is the token's rules and the client side (no web framework: the operator's image
has none); servers install the check with ``core.service.install_internal_auth``.
"""

from __future__ import annotations

import hmac

TOKEN_ENV = "AGENTSERVING_INTERNAL_TOKEN"

OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/docs", "/docs/oauth2-redirect",
                        "/redoc", "/openapi.json"})

TOKEN_HELP = ("Shared secret of AgentServing's components: required as a Bearer token on the "
              "kvindex's and the memory APIs' routes (health, metrics and docs stay open) and "
              f"sent on every call to them. Prefer the environment variable {TOKEN_ENV} (a "
              "command line is visible to every process on the host). Unset: no checks.")

def auth_headers(token: str | None) -> dict[str, str]:
    """The headers a client sends with ``token`` (none without one)."""
    return {"authorization": f"Bearer {token}"} if token else {}


def bearer_of(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, else None."""
    scheme, _, value = (header or "").partition(" ")
    return value.strip() or None if scheme.lower() == "bearer" else None


def check_token(header: str | None, token: str) -> tuple[int, str] | None:
    """None if ``header`` carries ``token``; else (status, message): 401 without credentials,
    403 with the wrong ones (compared in constant time)."""
    given = bearer_of(header)
    if given is None:
        return 401, "missing credentials: send 'Authorization: Bearer <internal token>'"
    if not hmac.compare_digest(given.encode(), token.encode()):
        return 403, "the internal token given is not this deployment's"
    return None
