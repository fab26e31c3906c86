"""The kvindex's two interfaces and the pure rules every backend shares.

``Index`` is the cluster's directory of KV residency: which pod holds which chunk in which
tier, and which pods are alive. ``SessionStore`` is the agent memory layer's map from a
session's intents to the chunks they reuse, with copy-on-write sharing between forks.

Contract every backend honours (``tests/test_contract.py`` runs against each):
- A pod exists from ``register_pod`` until ``deregister`` or until its lease lapses; a lapsed
  pod is invisible to every read at once, and ``expire_leases`` then drops it together with
  all of its residency in one atomic step.
- Residency is only what pods reported (``apply_events``/``replace_chunks``): the index never
  claims a chunk a pod has not confirmed. Batches are idempotent by ``seq``: a replayed seq is
  ignored, a gap is applied but flags the pod ``needs_resync`` until a snapshot arrives.
- ``lookup`` walks the chain in order and, for each live pod, counts how many leading chunks it
  holds (any tier) and which tier is the fastest for each of them.
- A session's routing record (``put_route``) lives apart from the session, until its own TTL
  or the session's close; it references no chunk.
- A stored response (``put_stored_response``: the proxy's Responses API object with its
  conversation, opaque JSON) lives until its TTL or its delete, apart from every session; a
  put past ``max_count`` of them drops the oldest written first, expired or not.
- A session lives until it is closed or until it expires idle: every write to it (intents,
  pin, release, priority) moves its expiry to ``session_expiry(now, idle_ttl_s, pin)``; an
  expired session is invisible to every read at once (its references stop protecting chunks),
  a write that would create it starts it afresh, and ``expire_sessions`` then drops it with its
  references. What a session's pin, priority and liveness imply for an evict is decided here,
  by ``protected_chunks`` over what ``references`` reports, never inside a backend.
- A backend that cannot reach its store raises ``BackendUnavailable`` at once (the HTTP layer
  answers 503 and the proxy routes without the index); nothing stored is lost by that.
- All methods are safe to call concurrently from one event loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from agentserving.core.residency import (  # noqa: F401 (the backends' shared rules)
    TIER_BITS,
    TIER_WEIGHTS,
    PrefixCount,
    answer_lookup,
    fastest_tier,
    prefix_of,
    rank_prefixes,
    role_matches,
    score,
    tiers_of,
)
from agentserving.core.schemas import (
    DEFAULT_PRIORITY,
    ChunkLocation,
    ChunkSnapshot,
    EventBatch,
    EventBatchResult,
    LeaseInfo,
    PodInfo,
    PodRegistration,
    PodRole,
    SessionInfo,
)


class KvIndexError(Exception):
    """Base of the errors the HTTP layer maps to status codes."""


class UnknownPod(KvIndexError):
    def __init__(self, pod: str) -> None:
        super().__init__(f"unknown pod '{pod}'")
        self.pod = pod


class UnknownSession(KvIndexError):
    def __init__(self, session_id: str, intent: str | None = None) -> None:
        what = f"session '{session_id}'" + (f" has no intent '{intent}'" if intent else "")
        super().__init__(what if intent else f"unknown {what}")
        self.session_id = session_id


class SessionExists(KvIndexError):
    def __init__(self, session_id: str) -> None:
        super().__init__(f"session '{session_id}' already exists")


class BackendUnavailable(KvIndexError):
    """The store behind the index cannot be reached; callers should degrade, not retry hard."""


def next_seq_state(last_seq: int, needs_resync: bool, seq: int) -> tuple[bool, bool]:
    """(apply, needs_resync) for a batch numbered ``seq`` after ``last_seq``.

    The first batch of a pod may carry any seq (a restarted pod, or one that registered late).
    A replayed seq is not applied again; a gap is applied (it is still true) but marks the pod
    for a full resync, since what happened in the gap is unknown.
    """
    if last_seq < 0:
        return True, needs_resync
    if seq <= last_seq:
        return False, needs_resync
    return True, needs_resync or seq != last_seq + 1


# ------------------------------------------------------------------ session lifecycle


def session_expiry(now: float, idle_ttl_s: float | None, pinned_until: float | None
                   ) -> float | None:
    """When a session written at ``now`` expires: ``idle_ttl_s`` after its last write, or when
    its pin lapses if that is later (a pin is a promise to keep the chunks through a tool gap,
    so the session must outlive it). None: never (no idle TTL configured)."""
    if not idle_ttl_s or idle_ttl_s <= 0:
        return None
    return max(now + idle_ttl_s, pinned_until or 0.0)


def dropped_context(previous: list[str], current: list[str]) -> list[str]:
    """The chunks of a session's previous context its new turn left (seed 000's
    ``diff_deleted``), in chain order: none when the new chain extends the previous one (an
    ordinary next turn); the previous chain's tail from the first chunk that differs when it
    diverges before the previous end (the agent compacted, summarised or edited its history).
    Chunk hashes are chained, so a chunk after the divergence cannot recur in the new chain;
    one that does is kept all the same."""
    common = 0
    for old, new in zip(previous, current, strict=False):
        if old != new:
            break
        common += 1
    if common == len(previous):
        return []
    kept = set(current)
    return [c for c in dict.fromkeys(previous[common:]) if c not in kept]


@dataclass(frozen=True)
class SessionLife:
    """What eviction needs to know of one session, as stored (times are the store's clock)."""

    expires_at: float | None = None
    pinned_until: float | None = None
    priority: int = DEFAULT_PRIORITY

    def live(self, now: float) -> bool:
        return self.expires_at is None or now < self.expires_at

    def pinned(self, now: float) -> bool:
        return self.pinned_until is not None and now < self.pinned_until


@dataclass
class SessionRefs:
    """A backend's answer to ``references``: which sessions name each chunk, their lifecycle,
    and the store's clock when it read them (the decision must use the same ``now``)."""

    now: float
    refs: dict[str, list[str]] = field(default_factory=dict)  # chunk -> session ids
    sessions: dict[str, SessionLife] = field(default_factory=dict)


def eviction_priority(requested: int | None, asker: SessionLife | None, now: float) -> int:
    """An evict's priority: the one asked for, else the asking session's (a high-priority agent
    may push out a low-priority one's chunks, not the reverse), else the default, which every
    session has unless told otherwise: so by default any live reference protects."""
    if requested is not None:
        return requested
    if asker is not None and asker.live(now):
        return asker.priority
    return DEFAULT_PRIORITY


def protected_chunks(refs: SessionRefs, *, asker: str | None, priority: int | None) -> set[str]:
    """The chunks a non-forced evict must keep: those a live session other than ``asker``
    references while it is pinned or of priority >= ``priority`` (``None``: any live reference
    protects, as when a session closes and must not take what others still use).

    The asker's own references never protect, its own pin neither: a session evicting its own
    old topic means it. Expired sessions protect nothing, whether reaped yet or not."""
    now = refs.now
    keep: set[str] = set()
    for chunk, sids in refs.refs.items():
        for sid in sids:
            life = refs.sessions.get(sid)
            if sid == asker or life is None or not life.live(now):
                continue
            if priority is None or life.pinned(now) or life.priority >= priority:
                keep.add(chunk)
                break
    return keep


def pinned_by_others(refs: SessionRefs, *, asker: str) -> set[str]:
    """The chunks a live session other than ``asker`` references while pinned: a release of
    ``asker``'s pin must leave the pods' pins on them (one pin per chunk on a pod)."""
    now = refs.now
    return {chunk for chunk, sids in refs.refs.items()
            if any(sid != asker and (life := refs.sessions.get(sid)) is not None
                   and life.live(now) and life.pinned(now) for sid in sids)}


@runtime_checkable
class Index(Protocol):
    async def register_pod(self, reg: PodRegistration, ttl_s: float) -> PodInfo: ...

    async def heartbeat(self, pod: str, ttl_s: float) -> LeaseInfo: ...

    async def deregister(self, pod: str) -> bool: ...

    async def get_pod(self, pod: str) -> PodInfo: ...

    async def list_pods(self) -> list[PodInfo]: ...

    async def apply_events(self, batch: EventBatch) -> EventBatchResult: ...

    async def replace_chunks(self, pod: str, snapshot: ChunkSnapshot) -> LeaseInfo: ...

    async def locate(self, chunk_hash: str) -> list[ChunkLocation]: ...

    async def lookup(
        self, chunk_hashes: list[str], pods: list[str] | None = None,
        role: PodRole | None = None,
    ) -> list[PrefixCount]: ...

    async def holders(self, chunk_hashes: list[str]) -> dict[str, dict[str, int]]:
        """pod -> {chunk_hash: tier mask} for the given chunks held by live pods."""
        ...

    async def pod_chunks(self, pod: str) -> dict[str, int]:
        """Every chunk a live pod holds -> its tier mask (``UnknownPod`` when not live): what
        a follower of the change feed lists."""
        ...

    async def expire_leases(self) -> list[str]:
        """Drop every pod whose lease lapsed, with its residency; return their names."""
        ...

    async def ping(self) -> None: ...

    async def close(self) -> None: ...


@runtime_checkable
class SessionStore(Protocol):
    """Every write takes ``idle_ttl_s`` (the kvindex's ``--session-idle-ttl``; None: sessions
    never expire idle) and moves the session's expiry by ``session_expiry``."""

    async def put_intent(self, session_id: str, intent: str, chunks: list[str],
                         idle_ttl_s: float | None = None) -> SessionInfo: ...

    async def get_intent(self, session_id: str, intent: str) -> list[str]: ...

    async def delete_intent(self, session_id: str, intent: str,
                            idle_ttl_s: float | None = None) -> SessionInfo: ...

    async def get_session(self, session_id: str) -> SessionInfo: ...

    async def close_session(self, session_id: str) -> list[str] | None:
        """Drop the session with its references; the chunks it referenced (sorted), or None
        when no live session has that id."""
        ...

    async def fork(self, session_id: str, child: str,
                   idle_ttl_s: float | None = None) -> SessionInfo:
        """The child starts with the parent's intents and priority (not its pin); shared chunks
        count one reference each."""
        ...

    async def pin(self, session_id: str, ttl_s: float,
                  idle_ttl_s: float | None = None) -> SessionInfo:
        """Pin the session's chunks for ``ttl_s`` from now (replacing any pin)."""
        ...

    async def release(self, session_id: str, idle_ttl_s: float | None = None) -> SessionInfo:
        """Drop the session's pin (none is fine)."""
        ...

    async def set_priority(self, session_id: str, priority: int,
                           idle_ttl_s: float | None = None) -> SessionInfo: ...

    async def references(self, chunk_hashes: list[str],
                         also: str | None = None) -> SessionRefs:
        """The sessions (live or expired-but-unreaped) naming each of these chunks, with the
        lifecycle of each and of ``also`` (the asker) if it exists; chunks no session names
        are left out."""
        ...

    async def expire_sessions(self) -> list[str]:
        """Drop every session whose expiry passed, with its references; return their ids."""
        ...

    async def put_route(self, session_id: str, route: str, ttl_s: float | None = None
                        ) -> None:
        """Keep a session's routing record (the proxy's, opaque JSON) for ``ttl_s`` (None:
        until its session closes). Apart from the session itself: a record references no
        chunk, protects nothing and creates no session."""
        ...

    async def get_route(self, session_id: str) -> str | None:
        """The session's routing record, or None (never written, expired, closed)."""
        ...

    async def put_stored_response(self, key: str, value: str, ttl_s: float,
                                  max_count: int) -> None:
        """Keep ``value`` under ``key`` for ``ttl_s`` (rewriting it makes it the newest);
        then, past ``max_count`` kept, drop the oldest written, so a flood of ``store: true``
        responses cannot grow the store without bound whatever their TTLs."""
        ...

    async def get_stored_response(self, key: str) -> str | None:
        """The stored value, or None (never stored, expired, deleted, pushed out)."""
        ...

    async def delete_stored_response(self, key: str) -> bool:
        """Drop it; False when nothing live was stored under ``key``."""
        ...

    async def ping(self) -> None: ...

    async def close(self) -> None: ...
