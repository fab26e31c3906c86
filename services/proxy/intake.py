"""A turn's body and headers read into a ``Turn``, whichever API it came in by: the checks
every turn gets (a client may not set the P/D hand-off), its memory verbs and hints taken
off, the tenant's cache salt put on, and its session named (``session_identity``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agentserving.core.service import ApiError
from agentserving.proxy.auth import Principal
from agentserving.proxy.jsonio import loads
from agentserving.proxy.memory_hooks import AgentMemory
from agentserving.proxy.metrics import ProxyMetrics
from agentserving.proxy.orchestrator import H_NEXT_TOOL, Turn
from agentserving.proxy.request_hints import merged_memory, read_hints, validated_field
from agentserving.proxy.session_identity import BodyIds, SessionIdentity, identify
from agentserving.proxy.sessions import session_key


def json_body(raw: bytes) -> dict[str, Any]:
    """The request's JSON object, or a 400 saying why not."""
    try:
        body = loads(raw)
    except ValueError as exc:
        raise ApiError(400, f"malformed JSON: {exc}", param="body") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "body must be a JSON object", param="body")
    return body


def chat_ids(body: Mapping[str, Any]) -> BodyIds:
    """The fields of an OpenAI body that may name its session."""
    return BodyIds(prompt_cache_key=body.get("prompt_cache_key"), user=body.get("user"))


def read_turn(headers: Mapping[str, str], principal: Principal | None, endpoint: str,
              body: dict[str, Any], identity: SessionIdentity | None = None,
              metrics: ProxyMetrics | None = None, api: str = "chat") -> Turn:
    """``body`` (an OpenAI completion or chat request, changed in place) as a turn;
    ``identity`` when the caller named the session already, else from the body's own ids;
    counted by ``api`` and what named its session."""
    if "stream" in body and not isinstance(body["stream"], bool):
        raise ApiError(400, "stream: must be a boolean", param="stream")
    if "kv_transfer_params" in body:  # a client's would send a pod pulling KV from anywhere
        raise ApiError(400, "kv_transfer_params: the P/D hand-off's parameters are the "
                       "proxy's to set, not a client's", param="kv_transfer_params")
    raw = body.pop("agent_memory", None)
    memory = validated_field(AgentMemory, raw, "agent_memory") if raw is not None else None
    hints = read_hints(body)
    memory = merged_memory(memory, hints)
    tenant = principal.tenant if principal else None
    if principal is not None and principal.cache_salt:
        body["cache_salt"] = principal.cache_salt  # tenants never share or probe prefixes
    who = identity or identify(headers, chat_ids(body))
    if metrics is not None:
        metrics.api_turns.labels(api, who.source or "none").inc()
    return Turn(endpoint=endpoint, body=body, session_id=who.session_id,
                session_key=session_key(tenant, who.session_id), tenant=tenant,
                parent_session_id=who.parent_session_id, memory=memory,
                next_tool=headers.get(H_NEXT_TOOL), announce_next=hints.speculative_prefill)
