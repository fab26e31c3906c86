"""The agent memory hooks of seed 000, section 6, driven by the ``agent_memory`` field.

Before a turn: evict the chunks of topics the agent left (``evict_intents``) and prefetch the
chunks of the topics it is about to reuse (``prefetch_intents``), both through the kvindex,
which fans out to the pods holding them. After the turn: write the turn's chunk hashes back
under ``intent``. Every call is best effort: a memory hook never fails a turn.
"""

from __future__ import annotations

import asyncio

from pydantic import BaseModel, ConfigDict, Field

from agentserving.core.clients import KvindexClient, NotFound, RequestRejected, ServiceUnavailable
from agentserving.core.schemas import EvictRequest, PrefetchRequest


class AgentMemory(BaseModel):
    model_config = ConfigDict(extra="forbid")

    intent: str | None = Field(default=None, min_length=1, max_length=256)
    evict_intents: list[str] = Field(default_factory=list)
    prefetch_intents: list[str] = Field(default_factory=list)


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


async def after_turn(kv: KvindexClient, sid: str, mem: AgentMemory, chunk_hashes: list[str],
                     record) -> None:  # type: ignore[no-untyped-def]
    if mem.intent is None:
        return
    try:
        await kv.put_intent(sid, mem.intent, chunk_hashes)
        record("write", True)
    except (ServiceUnavailable, RequestRejected):
        record("write", False)
