"""Prefetch and evict, fanned out to the memory APIs of the pods that hold the chunks.

Deciding is pure (``plan_*``: which pod gets which chunks); acting is one parallel round of
HTTP calls with a timeout each (``call_pods``). The index is not updated from the answers: a
pod confirms what it moved through its own residency events, so the index never claims what a
pod has not confirmed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import httpx

from agentserving.core.schemas import TIER_BACKENDS, PodCallResult, PodInfo, Tier
from agentserving.kvindex.index.base import TIER_BITS

_BACKEND_TIERS = {backend: tier for tier, backend in TIER_BACKENDS.items()}


def tiers_for_locations(locations: Iterable[str] | None) -> set[Tier] | None:
    """Accept tier names ('cpu') and LMCache backend names ('LocalCPUBackend')."""
    if locations is None:
        return None
    out = set()
    for loc in locations:
        if loc in _BACKEND_TIERS:
            out.add(_BACKEND_TIERS[loc])
        else:
            try:
                out.add(Tier(loc))
            except ValueError:
                known = sorted([t.value for t in Tier] + list(_BACKEND_TIERS))
                raise ValueError(f"unknown location '{loc}'; expected one of {known}") from None
    return out


def backends_for_locations(locations: Iterable[str] | None) -> list[str] | None:
    """The memory API's ``locations`` (LMCache backend names) for tier or backend names."""
    tiers = tiers_for_locations(locations)
    if tiers is None:
        return None
    return sorted(TIER_BACKENDS[t] for t in tiers if t in TIER_BACKENDS)


def plan(chunk_hashes: list[str], holders: dict[str, dict[str, int]], *,
         only_pod: str | None = None, tiers: set[Tier] | None = None,
         skip: set[str] = frozenset()) -> tuple[dict[str, list[str]], list[str]]:
    """(pod -> its chunks to act on, in request order; chunks none of the asked pods hold)."""
    bits = sum(TIER_BITS[t] for t in tiers) if tiers is not None else -1
    per_pod: dict[str, list[str]] = {}
    held = set()
    for pod, chunks in sorted(holders.items()):
        if only_pod is not None and pod != only_pod:
            continue
        mine = [c for c in chunk_hashes if c not in skip and chunks.get(c, 0) & bits]
        held.update(c for c in chunk_hashes if c in chunks)
        if mine:
            per_pod[pod] = mine
    missing = [c for c in chunk_hashes if c not in held]
    return per_pod, missing


def freed_by_tier(per_pod: dict[str, list[str]], holders: dict[str, dict[str, int]],
                  pods: dict[str, PodInfo], results: dict[str, PodCallResult]
                  ) -> dict[Tier, tuple[int, int]]:
    """Tier -> (chunks, bytes) an evict freed: each chunk a pod accepted to drop, counted in
    every tier the index had it there; its bytes by that pod's own average chunk size in the
    tier (its reported used bytes over its chunks; 0 where it reports none)."""
    out: dict[Tier, list[int]] = {}
    for pod, chunks in per_pod.items():
        result, info = results.get(pod), pods.get(pod)
        if result is None or not result.ok:
            continue
        held = holders.get(pod, {})
        for tier, bit in TIER_BITS.items():
            n = sum(1 for c in chunks if held.get(c, 0) & bit)
            if not n:
                continue
            count = info.chunks.get(tier, 0) if info is not None else 0
            used = info.used_bytes.get(tier, 0) if info is not None else 0
            acc = out.setdefault(tier, [0, 0])
            acc[0] += n
            acc[1] += n * used // count if count else 0
    return {tier: (n, b) for tier, (n, b) in out.items()}


async def call_pods(client: httpx.AsyncClient, pods: dict[str, PodInfo], path: str,
                    bodies: dict[str, dict], timeout_s: float) -> dict[str, PodCallResult]:
    """POST ``bodies[pod]`` to each pod's memory API in parallel; failures become results."""

    async def one(pod: str, body: dict) -> tuple[str, PodCallResult]:
        n = len(body.get("chunk_hashes", ()))
        info = pods.get(pod)
        if info is None:
            return pod, PodCallResult(ok=False, num_chunks=n, error="pod is not registered")
        try:
            resp = await client.post(info.memory_api_url + path, json=body, timeout=timeout_s)
        except (httpx.HTTPError, httpx.InvalidURL) as exc:  # a registration's URL httpx
            return pod, PodCallResult(ok=False, num_chunks=n,  # cannot send to is a failure
                                      error=f"{type(exc).__name__}: {exc}".strip(": "))
        try:
            payload = resp.json()
        except ValueError:
            payload = {"text": resp.text[:500]}
        return pod, PodCallResult(ok=resp.is_success, num_chunks=n, status_code=resp.status_code,
                                  response=payload if isinstance(payload, dict) else None,
                                  error=None if resp.is_success else f"HTTP {resp.status_code}")

    results = await asyncio.gather(*(one(p, b) for p, b in bodies.items()))
    return dict(results)
