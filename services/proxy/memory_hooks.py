"""The agent memory hooks of seed 000, section 6, driven by the ``agent_memory`` field.

Before a turn: evict the chunks of topics the agent left (``evict_intents``) and prefetch the
chunks of the topics it is about to reuse (``prefetch_intents``), both through the kvindex,
which fans out to the pods holding them. After the turn: write the turn's chunk hashes back
under ``intent``, then carry out the session's KV lifecycle verbs in the kvindex: its eviction
``priority``, a pin for ``pin_ttl_s`` (the turn ends in a tool call; keep its KV through the
gap, then let it go by itself; ``pin`` lets the proxy size it from its tool-gap prediction) or
its ``release``, and on the final turn ``close_session``
(the kvindex evicts the session's chunks that no other live session uses). Every call is best
effort: a memory hook never fails a turn.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationInfo, field_validator

from agentserving.core.clients import KvindexClient, NotFound, RequestRejected, ServiceUnavailable
from agentserving.core.schemas import (
    CONTEXT_INTENT,
    EvictRequest,
    PinTtl,
    PrefetchRequest,
    Priority,
)


def _never_both(letting_go: str, keeping: str, kept: dict) -> dict:
    """JSON Schema: ``letting_go`` true and ``keeping`` set (``kept``) cannot come together."""
    return {"not": {"required": [letting_go, keeping],
                    "properties": {letting_go: {"const": True}, keeping: kept}}}


# what _not_with_a_pin refuses, said in the schema (a client generator or a fuzzer reads it)
_CONFLICTS = [_never_both(go, keep, kept)
              for go in ("release", "close_session")
              for keep, kept in (("pin_ttl_s", {"not": {"type": "null"}}),
                                 ("pin", {"const": True}))]


class AgentMemory(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"allOf": _CONFLICTS})

    intent: str | None = Field(default=None, min_length=1, max_length=256)
    evict_intents: list[str] = Field(default_factory=list)
    prefetch_intents: list[str] = Field(default_factory=list)
    priority: Priority | None = Field(
        default=None, description="After the turn, set the session's eviction priority: an "
        "evict at or below it keeps the session's chunks.")
    pin_ttl_s: PinTtl | None = Field(
        default=None, description="After the turn, pin the session's chunks for this many "
        "seconds (e.g. the tool call the turn ends in); the pin lapses by itself.")
    pin: StrictBool = Field(
        default=False, description="After the turn, pin the session's chunks for the "
        "proxy's predicted tool gap (between --pin-ttl-floor and --pin-ttl-cap); a "
        "pin_ttl_s given is the pin's TTL.")
    release: StrictBool = Field(default=False,
                                description="After the turn, drop the session's pin.")
    close_session: StrictBool = Field(
        default=False, description="This is the session's final turn: after it, close the "
        "session, evicting its chunks that no other live session uses from every tier.")

    @field_validator("intent", "evict_intents", "prefetch_intents")
    @classmethod
    def _not_the_context(cls, value: str | list[str] | None) -> str | list[str] | None:
        """The session's context is the proxy's to write (after every turn)."""
        if value == CONTEXT_INTENT or isinstance(value, list) and CONTEXT_INTENT in value:
            raise ValueError(f"'{CONTEXT_INTENT}' is the session's context, kept by the proxy")
        return value

    @field_validator("pin", "release", "close_session")
    @classmethod
    def _not_with_a_pin(cls, value: bool, info: ValidationInfo) -> bool:
        """A pin asks to keep the KV, a release or a close to let it go: say which field
        conflicts rather than pick one silently."""
        if value and info.field_name != "pin" and info.data.get("pin_ttl_s") is not None:
            raise ValueError("cannot be true together with pin_ttl_s")
        if value and info.field_name != "pin" and info.data.get("pin"):
            raise ValueError("cannot be true together with pin")
        return value


async def _intent_chunks(kv: KvindexClient, sid: str, intent: str) -> list[str]:
    try:
        return await kv.get_intent(sid, intent)
    except NotFound:
        return []


async def before_turn(kv: KvindexClient, sid: str, mem: AgentMemory, record) -> None:  # type: ignore[no-untyped-def]
    async def evict(intent: str) -> None:
        try:
            chunks = await _intent_chunks(kv, sid, intent)
            if chunks:
                await kv.evict(EvictRequest(chunk_hashes=chunks, session_id=sid))
            record("evict", True)
        except (ServiceUnavailable, RequestRejected):
            record("evict", False)

    async def prefetch(intent: str) -> None:
        try:
            chunks = await _intent_chunks(kv, sid, intent)
            if chunks:
                await kv.prefetch(PrefetchRequest(chunk_hashes=chunks, lookup_id=f"{sid}:{intent}"))
            record("prefetch", True)
        except (ServiceUnavailable, RequestRejected):
            record("prefetch", False)

    await asyncio.gather(*(evict(i) for i in mem.evict_intents),
                         *(prefetch(i) for i in mem.prefetch_intents))


def lifecycle_calls(kv: KvindexClient, sid: str, mem: AgentMemory, pods: Sequence[str] = ()
                    ) -> list[tuple[str, Callable[[], Awaitable[object]]]]:
    """The kvindex calls the lifecycle fields ask for, in the order they must run: after the
    intent write-back, so they act on the session as this turn left it; a close comes last
    and makes a release moot (closing drops the pin with the session). ``pods``: those the
    turn ran on, which a pin reaches before their residency reports name the turn's chunks."""
    calls: list[tuple[str, Callable[[], Awaitable[object]]]] = []
    if mem.priority is not None:
        priority = mem.priority
        calls.append(("priority", lambda: kv.set_priority(sid, priority)))
    if mem.pin_ttl_s is not None:
        ttl_s = mem.pin_ttl_s
        calls.append(("pin", lambda: kv.pin(sid, ttl_s, pods)))
    if mem.release and not mem.close_session:
        calls.append(("release", lambda: kv.release(sid)))
    if mem.close_session:
        calls.append(("close", lambda: kv.close_session(sid)))
    return calls


async def after_turn(kv: KvindexClient, sid: str, mem: AgentMemory,  # type: ignore[no-untyped-def]
                     chunk_hashes: list[str] | None, record, pods: Sequence[str] = ()) -> None:
    """``chunk_hashes`` None: the engine named no chunks for this turn (nothing to write back
    under ``intent``); the lifecycle verbs still run."""
    if mem.intent is not None and chunk_hashes is not None:
        try:
            await kv.put_intent(sid, mem.intent, chunk_hashes)
            record("write", True)
        except (ServiceUnavailable, RequestRejected):
            record("write", False)
    for op, call in lifecycle_calls(kv, sid, mem, pods):
        try:
            await call()
            record(op, True)
        except (ServiceUnavailable, RequestRejected):  # NotFound too: no session to act on
            record(op, False)
