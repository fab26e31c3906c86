"""Prefetch and evict by chunk hash, fanned out to the pods that hold them.

An evict that is not forced keeps the chunks live sessions still need; which ones is decided by
``protected_chunks`` (pins, priorities, idle expiry) over what the session store reports.
"""

from __future__ import annotations

from collections.abc import Iterable

from fastapi import APIRouter, Depends

from agentserving.core.schemas import EvictRequest, FanoutResponse, PrefetchRequest, Tier
from agentserving.core.service import ApiError, error_responses
from agentserving.kvindex.controllers.fanout import (
    backends_for_locations,
    call_pods,
    freed_by_tier,
    plan,
    tiers_for_locations,
)
from agentserving.kvindex.http_apis.deps import KvindexState, guarded, state
from agentserving.kvindex.http_apis.scope import SessionScope, session_scope
from agentserving.kvindex.http_apis.validation import check_chain_size
from agentserving.kvindex.index.base import eviction_priority, protected_chunks

router = APIRouter(prefix="/v1", tags=["control"], responses=error_responses(503))


async def _live_pods(st: KvindexState) -> dict:
    return {p.pod: p for p in await guarded(st, st.index.list_pods())}


async def _call_pods(st: KvindexState, pods: dict, op: str,
                     bodies: dict[str, dict]) -> dict:
    """``POST /memory/{op}`` to each pod with its body, each call counted by outcome."""
    results = await call_pods(st.http, pods, f"/memory/{op}", bodies,
                              st.settings.fanout_timeout_s)
    for r in results.values():
        st.metrics.fanout.labels(op, str(r.ok).lower()).inc()
    return results


def _check_pod(pod: str | None, pods: dict) -> None:
    if pod is not None and pod not in pods:
        raise ApiError(404, f"unknown pod '{pod}'", param="pod", type="not_found_error")


@router.post("/prefetch", response_model=FanoutResponse, responses=error_responses(404, 413),
             summary="Ask the holders of these chunks to load them from disk into DRAM.")
async def prefetch(req: PrefetchRequest, st: KvindexState = Depends(state)) -> FanoutResponse:
    check_chain_size(req.chunk_hashes, st.settings.max_batch_chunks)
    pods = await _live_pods(st)
    _check_pod(req.pod, pods)
    holders = await guarded(st, st.index.holders(req.chunk_hashes))
    per_pod, missing = plan(req.chunk_hashes, holders, only_pod=req.pod)
    announced = req.model_dump(include={"expected_in_s", "expected_tokens", "hold_s"},
                               exclude_none=True)
    bodies = {pod: {"chunk_hashes": chunks, "lookup_id": req.lookup_id, **announced}
              for pod, chunks in per_pod.items()}
    results = await _call_pods(st, pods, "prefetch", bodies)
    return FanoutResponse(lookup_id=req.lookup_id, results=results, missing=missing)


async def fan_out_evict(st: KvindexState, chunk_hashes: list[str], protected: set[str], *,
                        locations: list[str] | None = None, tiers: set[Tier] | None = None,
                        pod: str | None = None, pods: dict | None = None,
                        reclaimed: str | None = None) -> FanoutResponse:
    """Ask every live holder of ``chunk_hashes`` but the ``protected`` to drop them from the
    named tiers (None: every tier). Shared by ``POST /v1/evict``, closing a session and a
    context change; ``reclaimed`` names the lifecycle reason its frees are counted under."""
    pods = await _live_pods(st) if pods is None else pods
    holders = await guarded(st, st.index.holders(chunk_hashes))
    per_pod, missing = plan(chunk_hashes, holders, only_pod=pod, tiers=tiers, skip=protected)
    backends = backends_for_locations(locations)
    bodies = {p: {"chunk_hashes": chunks, **({"locations": backends} if backends else {})}
              for p, chunks in per_pod.items()}
    results = await _call_pods(st, pods, "evict", bodies)
    if reclaimed is not None:
        for tier, (n, size) in freed_by_tier(per_pod, holders, pods, results).items():
            st.metrics.reclaimed_chunks.labels(reclaimed, tier.value).inc(n)
            st.metrics.reclaimed_bytes.labels(reclaimed, tier.value).inc(size)
    return FanoutResponse(results=results, missing=missing,
                          protected=[c for c in chunk_hashes if c in protected])


async def fan_out_pins(st: KvindexState, chunk_hashes: list[str], *, ttl_s: float | None,
                       also_pods: Iterable[str | None] = ()) -> FanoutResponse:
    """Pin (``ttl_s``) or unpin (None) ``chunk_hashes`` in the tiers of the pods holding
    them, so the pods' own eviction (LMCache's LRU) keeps them too. ``also_pods`` (the pods the
    session's last turn ran on) are asked for every chunk: the residency reports lag a turn that
    has just ended, and a pod answers chunks it lacks as missing."""
    if not chunk_hashes:
        return FanoutResponse(results={}, missing=[])
    pods = await _live_pods(st)
    holders = await guarded(st, st.index.holders(chunk_hashes))
    per_pod, missing = plan(chunk_hashes, holders)
    for pod in also_pods:
        if pod is not None and pod in pods:
            per_pod[pod], missing = chunk_hashes, []
    extra = {"ttl_s": ttl_s} if ttl_s is not None else {}
    results = await _call_pods(st, pods, "pin" if ttl_s is not None else "unpin",
                               {p: {"chunk_hashes": c, **extra} for p, c in per_pod.items()})
    return FanoutResponse(results=results, missing=missing)


@router.post("/evict", response_model=FanoutResponse,
             responses=error_responses(400, 404, 413),
             summary="Ask the holders of these chunks to drop them (named tiers, or all); "
                     "chunks live sessions pin or hold at this priority or above are kept.")
async def evict(req: EvictRequest, st: KvindexState = Depends(state),
                scope: SessionScope = Depends(session_scope)) -> FanoutResponse:
    check_chain_size(req.chunk_hashes, st.settings.max_batch_chunks)
    try:
        tiers = tiers_for_locations(req.locations)
    except ValueError as exc:
        raise ApiError(400, f"locations: {exc}", param="locations") from exc
    pods = await _live_pods(st)
    _check_pod(req.pod, pods)
    protected: set[str] = set()
    if not req.force:
        sid = scope.key(req.session_id) if req.session_id is not None else None
        refs = await guarded(st, st.sessions.references(req.chunk_hashes, also=sid))
        asker = refs.sessions.get(sid) if sid is not None else None
        protected = protected_chunks(
            refs, asker=sid,
            priority=eviction_priority(req.priority, asker, refs.now))
    return await fan_out_evict(st, req.chunk_hashes, protected, locations=req.locations,
                               tiers=tiers, pod=req.pod, pods=pods)
