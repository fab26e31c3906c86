"""Residency in (event batches) and out (where is a chunk; longest cached prefix per pod)."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from agentserving.core.residency import answer_lookup
from agentserving.core.schemas import (
    ChunkHash,
    ChunkLocations,
    EventBatch,
    EventBatchResult,
    LookupRequest,
    LookupResponse,
)
from agentserving.core.service import error_responses
from agentserving.kvindex.http_apis.deps import KvindexState, guarded, state
from agentserving.kvindex.http_apis.validation import check_batch_size, check_chain_size

router = APIRouter(prefix="/v1", tags=["residency"], responses=error_responses(503))


@router.post("/events", response_model=EventBatchResult, responses=error_responses(404, 413),
             summary="Apply a pod's batch of residency events (idempotent by seq).")
async def events(batch: EventBatch, st: KvindexState = Depends(state)) -> EventBatchResult:
    check_batch_size(batch, st.settings.max_batch_chunks)
    result = await guarded(st, st.index.apply_events(batch))
    st.metrics.batches.labels("applied" if result.applied else "replay").inc()
    st.metrics.chunk_events.labels("rest").inc(result.chunk_events)
    return result


@router.get("/chunks/{chunk_hash}", response_model=ChunkLocations,
            summary="Every (pod, tier) holding a chunk.")
async def locate(chunk_hash: ChunkHash, st: KvindexState = Depends(state)) -> ChunkLocations:
    return ChunkLocations(chunk_hash=chunk_hash,
                          locations=await guarded(st, st.index.locate(chunk_hash)))


@router.post("/lookup", response_model=LookupResponse, responses=error_responses(413),
             summary="For a prefix chain: each pod's cached prefix, its tiers, and the best pod.")
async def lookup(req: LookupRequest, st: KvindexState = Depends(state)) -> LookupResponse:
    check_chain_size(req.chunk_hashes, st.settings.max_batch_chunks)
    prefixes = await guarded(st, st.index.lookup(req.chunk_hashes, req.pods, req.role))
    found = answer_lookup(len(req.chunk_hashes), prefixes)
    st.metrics.lookups.labels("hit" if found.pods else "miss").inc()
    st.metrics.lookup_prefix.observe(found.pods[0].prefix_chunks if found.pods else 0)
    return found
