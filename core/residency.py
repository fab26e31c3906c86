"""The rules of KV residency every reader shares: a chunk's tiers as a bit mask, a pod's
cached prefix counted along a chain, and pods ranked by it. The kvindex's backends count with
them, and so does the proxy's in-process replica of the kvindex (``proxy/residency_replica``):
pure, so the two answer a lookup alike."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from agentserving.core.schemas import (
    TIERS_FASTEST_FIRST,
    LookupResponse,
    PodPrefix,
    PodRole,
    Tier,
)

# Tier weights for scoring a prefix: a device-resident chunk costs nothing to reuse, a DRAM one a
# copy, a disk one a read. Used to pick the best pod when prefixes tie or nearly tie.
TIER_WEIGHTS: dict[Tier, float] = {Tier.DEVICE: 1.0, Tier.CPU: 0.8, Tier.DISK: 0.5}

# Tiers as bits, so a (pod, chunk) residency is one small integer in every backend.
TIER_BITS: dict[Tier, int] = {Tier.DEVICE: 1, Tier.CPU: 2, Tier.DISK: 4}


def tiers_of(mask: int) -> list[Tier]:
    return [t for t in TIERS_FASTEST_FIRST if mask & TIER_BITS[t]]


def fastest_tier(mask: int) -> Tier | None:
    for tier in TIERS_FASTEST_FIRST:
        if mask & TIER_BITS[tier]:
            return tier
    return None


@dataclass
class PrefixCount:
    """One pod's answer to a lookup, before scoring."""

    pod: str
    prefix_chunks: int
    tiers: dict[Tier, int] = field(default_factory=dict)


def prefix_of(masks: Iterable[int]) -> PrefixCount | None:
    """Count leading non-zero masks and tally each one's fastest tier (pod filled by caller)."""
    tiers: dict[Tier, int] = {}
    n = 0
    for mask in masks:
        tier = fastest_tier(mask)
        if tier is None:
            break
        tiers[tier] = tiers.get(tier, 0) + 1
        n += 1
    return PrefixCount(pod="", prefix_chunks=n, tiers=tiers) if n else None


def score(prefix: PrefixCount) -> float:
    return sum(TIER_WEIGHTS[t] * n for t, n in prefix.tiers.items())


def rank_prefixes(prefixes: list[PrefixCount]) -> list[PodPrefix]:
    """Best pod first: highest tier-weighted score, then longest prefix, then name (stable)."""
    scored = sorted(((score(p), p) for p in prefixes),
                    key=lambda sp: (-sp[0], -sp[1].prefix_chunks, sp[1].pod))  # score once each
    return [
        PodPrefix(pod=p.pod, prefix_chunks=p.prefix_chunks, tiers=p.tiers, score=round(s, 6))
        for s, p in scored
    ]


def answer_lookup(num_chunks: int, prefixes: list[PrefixCount]) -> LookupResponse:
    """A lookup's answer, whoever counted the prefixes (the kvindex, a proxy's replica)."""
    ranked = rank_prefixes(prefixes)
    return LookupResponse(num_chunks=num_chunks, pods=ranked,
                          best_pod=ranked[0].pod if ranked else None)


def role_matches(pod_role: PodRole, wanted: PodRole | None) -> bool:
    return wanted is None or pod_role == wanted or pod_role == PodRole.BOTH
