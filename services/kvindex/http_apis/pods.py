"""Pods: register, heartbeat (lease), deregister, list; full residency snapshots."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Response

from agentserving.core.schemas import ChunkSnapshot, LeaseInfo, PodInfo, PodList, PodRegistration
from agentserving.core.service import ApiError, error_responses
from agentserving.kvindex.http_apis.deps import KvindexState, guarded, state
from agentserving.kvindex.http_apis.validation import check_snapshot_size

router = APIRouter(prefix="/v1/pods", tags=["pods"], responses=error_responses(503))


@router.post("", response_model=PodInfo, responses=error_responses(413),
             summary="Register a pod (or renew its registration).")
async def register(reg: PodRegistration, st: KvindexState = Depends(state)) -> PodInfo:
    return await guarded(st, st.index.register_pod(reg, st.settings.lease_ttl_s))


@router.get("", response_model=PodList, summary="Live pods with their residency counts.")
async def list_pods(st: KvindexState = Depends(state)) -> PodList:
    return PodList(pods=await guarded(st, st.index.list_pods()))


@router.get("/{pod}", response_model=PodInfo, responses=error_responses(404),
            summary="One live pod.")
async def get_pod(pod: str, st: KvindexState = Depends(state)) -> PodInfo:
    return await guarded(st, st.index.get_pod(pod))


@router.post("/{pod}/heartbeat", response_model=LeaseInfo, responses=error_responses(404),
             summary="Renew the pod's lease; the answer says whether it must resync.")
async def heartbeat(pod: str, st: KvindexState = Depends(state)) -> LeaseInfo:
    return await guarded(st, st.index.heartbeat(pod, st.settings.lease_ttl_s))


@router.delete("/{pod}", status_code=204, response_class=Response,
               responses=error_responses(404),
               summary="Deregister a pod; its residency goes with it, atomically.")
async def deregister(pod: str, st: KvindexState = Depends(state)) -> Response:
    if not await guarded(st, st.index.deregister(pod)):
        raise ApiError(404, f"unknown pod '{pod}'", param="pod", type="not_found_error")
    return Response(status_code=204)


@router.put("/{pod}/chunks", response_model=LeaseInfo, responses=error_responses(404, 413),
            summary="Replace the pod's residency with a full snapshot (after a sequence gap).")
async def snapshot(pod: str, snap: ChunkSnapshot, st: KvindexState = Depends(state)) -> LeaseInfo:
    check_snapshot_size(snap, st.settings.max_batch_chunks * 16)
    return await guarded(st, st.index.replace_chunks(pod, snap))
