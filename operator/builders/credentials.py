"""The deployment's internal token (``core.internal_auth``): one Secret per resource, read by
every AgentServing container as ``AGENTSERVING_INTERNAL_TOKEN``.

Each resource's token is an HMAC of its identity (namespace, name, uid) under the operator's
token key (``--token-key``, a Secret the chart makes once): the same on every reconcile pass,
so the Secret is an ordinary child, re-applied like the others, and the finalizer derives it
again to call the kvindex. The operator therefore needs to create and patch Secrets but never
to read one, and a resource deleted and made again under its name gets a new token. Rotate
every token by replacing the key and restarting the operator and then the pods.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from typing import Any

from agentserving.core.internal_auth import TOKEN_ENV

from .common import COMPONENT_LABEL, POOLS, Instance, metadata

TOKEN_KEY = "token"

# the components whose processes call or serve the kvindex, the memory APIs or the KV server's
# API (its evictions; with p2p the pods' servers pull from one another) -- not Redis
TOKEN_COMPONENTS = frozenset({*POOLS, "kvindex", "proxy", "kvserver"})


def internal_secret_name(resource: str) -> str:
    """The Secret of the resource named ``resource``."""
    return f"{resource}-internal"


def derive_token(key: str, namespace: str, name: str, uid: str) -> str:
    """One resource's token: stable for the key and the resource, unguessable without the
    key."""
    digest = hmac.new(key.encode(), f"{namespace}/{name}/{uid}".encode(), hashlib.sha256)
    return base64.urlsafe_b64encode(digest.digest()).decode().rstrip("=")


def build_internal_secret(inst: Instance, token: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata(inst, "internal", internal_secret_name(inst.name)),
        "type": "Opaque",
        "data": {TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def token_env(inst: Instance) -> dict[str, Any]:
    return {"name": TOKEN_ENV, "valueFrom": {"secretKeyRef": {
        "name": internal_secret_name(inst.name), "key": TOKEN_KEY}}}


def with_internal_token(inst: Instance, token: str,
                        children: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``children`` plus the token's Secret, with the token's variable first in every
    container of the AgentServing components' workloads (first, so that a user's own
    variable of the name still wins)."""
    for child in children:
        if child["kind"] not in ("Deployment", "StatefulSet"):
            continue
        if child["metadata"]["labels"].get(COMPONENT_LABEL) not in TOKEN_COMPONENTS:
            continue
        for container in child["spec"]["template"]["spec"]["containers"]:
            container["env"] = [token_env(inst), *container.get("env", [])]
    return [build_internal_secret(inst, token), *children]
