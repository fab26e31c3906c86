"""In-memory backends: the embedded default for one-process local runs and the tests' oracle.

State lives in plain dicts guarded by the event loop (every method runs to completion without
awaiting), so each method is atomic by construction.
"""

from __future__ import annotations

import time
from collections import OrderedDict, defaultdict

from agentserving.core.schemas import (
    DEFAULT_PRIORITY,
    TIERS_FASTEST_FIRST,
    ChunkLocation,
    ChunkSnapshot,
    EventBatch,
    EventBatchResult,
    EventOp,
    LeaseInfo,
    PodInfo,
    PodRegistration,
    PodRole,
    SessionInfo,
    Tier,
)
from agentserving.kvindex.index.base import (
    TIER_BITS,
    PrefixCount,
    SessionExists,
    SessionLife,
    SessionRefs,
    UnknownPod,
    UnknownSession,
    fastest_tier,
    next_seq_state,
    role_matches,
    session_expiry,
    tiers_of,
)

# (tier, bit) fastest first, as ``tiers_of`` walks them
_TIER_BIT_ITEMS = tuple((t, TIER_BITS[t]) for t in TIERS_FASTEST_FIRST)
# a residency mask -> its fastest tier (``fastest_tier``; None for 0), indexed by the mask:
# the lookup's per-chunk read
_FASTEST_BY_MASK = tuple(fastest_tier(m) for m in range(1 << len(TIER_BITS)))


class _Pod:
    def __init__(self, reg: PodRegistration, now: float, ttl_s: float) -> None:
        self.reg = reg
        self.registered_at = now
        self.last_heartbeat = now
        self.lease_expires_at = now + ttl_s
        self.seq = -1
        self.needs_resync = False
        self.chunks: dict[str, int] = {}  # chunk_hash -> tier mask
        self.counts: dict[Tier, int] = defaultdict(int)  # chunks per tier, kept incrementally
        self.used_bytes: dict[Tier, int] = defaultdict(int)

    def info(self) -> PodInfo:
        counts = {t: n for t, n in self.counts.items() if n}
        return PodInfo(
            **self.reg.model_dump(), registered_at=self.registered_at,
            last_heartbeat=self.last_heartbeat, lease_expires_at=self.lease_expires_at,
            seq=self.seq, needs_resync=self.needs_resync, chunks=counts,
            used_bytes={t: b for t, b in self.used_bytes.items() if b},
        )

    def lease(self) -> LeaseInfo:
        return LeaseInfo(pod=self.reg.pod, lease_expires_at=self.lease_expires_at, seq=self.seq,
                         needs_resync=self.needs_resync)


class InMemoryIndex:
    def __init__(self, clock=time.time) -> None:  # type: ignore[no-untyped-def]
        self._clock = clock
        self._pods: dict[str, _Pod] = {}
        self._chunks: dict[str, dict[str, int]] = {}  # chunk_hash -> {pod: tier mask}

    # -- pods
    def _live(self, pod: str) -> _Pod:
        state = self._pods.get(pod)
        if state is None or state.lease_expires_at <= self._clock():
            raise UnknownPod(pod)
        return state

    async def register_pod(self, reg: PodRegistration, ttl_s: float) -> PodInfo:
        now = self._clock()
        old = self._pods.get(reg.pod)
        if old is not None and old.lease_expires_at <= now:
            self._drop(reg.pod)
            old = None
        if old is None:
            self._pods[reg.pod] = _Pod(reg, now, ttl_s)
        else:  # re-registration keeps residency: a restarted API process, same KV store
            old.reg = reg
            old.last_heartbeat = now
            old.lease_expires_at = now + ttl_s
        return self._pods[reg.pod].info()

    async def heartbeat(self, pod: str, ttl_s: float) -> LeaseInfo:
        state = self._live(pod)
        state.last_heartbeat = self._clock()
        state.lease_expires_at = state.last_heartbeat + ttl_s
        return state.lease()

    async def deregister(self, pod: str) -> bool:
        if pod not in self._pods:
            return False
        self._drop(pod)
        return True

    async def get_pod(self, pod: str) -> PodInfo:
        return self._live(pod).info()

    async def list_pods(self) -> list[PodInfo]:
        now = self._clock()
        return [p.info() for name, p in sorted(self._pods.items()) if p.lease_expires_at > now]

    async def expire_leases(self) -> list[str]:
        now = self._clock()
        gone = [name for name, p in self._pods.items() if p.lease_expires_at <= now]
        for name in gone:
            self._drop(name)
        return gone

    def _drop(self, pod: str) -> None:
        state = self._pods.pop(pod)
        for chunk in state.chunks:
            holders = self._chunks.get(chunk)
            if holders is not None:
                holders.pop(pod, None)
                if not holders:
                    del self._chunks[chunk]

    # -- residency
    def _set_mask(self, state: _Pod, chunk: str, mask: int) -> None:
        pod = state.reg.pod
        old = state.chunks.get(chunk, 0)
        diff = old ^ mask
        if diff:
            counts = state.counts
            for tier, bit in _TIER_BIT_ITEMS:
                if diff & bit:
                    counts[tier] += 1 if mask & bit else -1
        if mask:
            state.chunks[chunk] = mask
            self._chunks.setdefault(chunk, {})[pod] = mask
        else:
            state.chunks.pop(chunk, None)
            holders = self._chunks.get(chunk)
            if holders is not None:
                holders.pop(pod, None)
                if not holders:
                    del self._chunks[chunk]

    async def apply_events(self, batch: EventBatch) -> EventBatchResult:
        state = self._live(batch.pod)
        apply, state.needs_resync = next_seq_state(state.seq, state.needs_resync, batch.seq)
        count = 0
        if apply:
            state.seq = batch.seq
            for event in batch.events:
                count += self._apply_one(state, event.op, event.tier, event.chunk_hashes,
                                         event.bytes)
        # model_construct: every field is a plain value computed here (a simulated cluster
        # applies ~10^6 batches; validating them was a visible share of its index time)
        return EventBatchResult.model_construct(pod=batch.pod, seq=batch.seq, applied=apply,
                                                chunk_events=count,
                                                needs_resync=state.needs_resync)

    def _apply_one(self, state: _Pod, op: EventOp, tier: Tier | None, chunks: list[str],
                   nbytes: int | None) -> int:
        if op is EventOp.CLEARED:
            bits = TIER_BITS[tier] if tier else sum(TIER_BITS.values())
            for chunk, mask in list(state.chunks.items()):
                self._set_mask(state, chunk, mask & ~bits)
            for t in [tier] if tier else list(state.used_bytes):
                state.used_bytes[t] = 0
            return 1
        assert tier is not None
        # ``_set_mask`` inlined for one tier bit (a large simulated cluster applies ~10^8 of
        # these): the pod's mask, the chunk's holders and the tier's count change together
        bit = TIER_BITS[tier]
        held = state.chunks
        get = held.get
        holders_of = self._chunks
        pod = state.reg.pod
        changed = 0
        if op is EventOp.STORED:
            for chunk in chunks:
                mask = get(chunk, 0)
                if mask & bit:      # already set: nothing changes
                    continue
                mask |= bit
                held[chunk] = mask
                holders = holders_of.get(chunk)
                if holders is None:
                    holders_of[chunk] = {pod: mask}
                else:
                    holders[pod] = mask
                changed += 1
            if changed:
                state.counts[tier] += changed
        else:
            for chunk in chunks:
                mask = get(chunk, 0)
                if not mask & bit:  # already clear: nothing changes
                    continue
                mask &= ~bit
                changed += 1
                if mask:
                    held[chunk] = mask
                    holders_of.setdefault(chunk, {})[pod] = mask
                else:
                    del held[chunk]
                    holders = holders_of.get(chunk)
                    if holders is not None:
                        holders.pop(pod, None)
                        if not holders:
                            del holders_of[chunk]
            if changed:
                state.counts[tier] -= changed
        if nbytes:
            sign = 1 if op is EventOp.STORED else -1
            state.used_bytes[tier] = max(0, state.used_bytes[tier] + sign * nbytes)
        return len(chunks)

    async def replace_chunks(self, pod: str, snapshot: ChunkSnapshot) -> LeaseInfo:
        state = self._live(pod)
        for chunk in list(state.chunks):
            self._set_mask(state, chunk, 0)
        for tier, chunks in snapshot.chunks.items():
            for chunk in chunks:
                self._set_mask(state, chunk, state.chunks.get(chunk, 0) | TIER_BITS[tier])
        state.used_bytes = defaultdict(int, snapshot.bytes)
        state.seq = snapshot.seq
        state.needs_resync = False
        return state.lease()

    async def locate(self, chunk_hash: str) -> list[ChunkLocation]:
        now = self._clock()
        out = []
        for pod, mask in sorted(self._chunks.get(chunk_hash, {}).items()):
            if self._pods[pod].lease_expires_at > now:
                out.extend(ChunkLocation(pod=pod, tier=t) for t in tiers_of(mask))
        return out

    async def lookup(self, chunk_hashes: list[str], pods: list[str] | None = None,
                     role: PodRole | None = None) -> list[PrefixCount]:
        if not chunk_hashes:
            return []
        now = self._clock()
        first = self._chunks.get(chunk_hashes[0], {})
        wanted = set(pods) if pods is not None else None
        out = []
        pods_state = self._pods
        fastest = _FASTEST_BY_MASK
        for pod in first:
            state = pods_state[pod]
            if state.lease_expires_at <= now or (wanted is not None and pod not in wanted):
                continue
            if role is not None and not role_matches(state.reg.role, role):
                continue
            # ``prefix_of`` over the pod's masks, inlined: the leading run of held chunks,
            # tallied by fastest tier, stopping at the first chunk the pod lacks (reading the
            # rest was most of a lookup's work when every pod holds a shared first chunk)
            get = state.chunks.get
            tiers: dict[Tier, int] = {}
            n = 0
            for c in chunk_hashes:
                tier = fastest[get(c, 0)]
                if tier is None:
                    break
                tiers[tier] = tiers.get(tier, 0) + 1
                n += 1
            if n:
                out.append(PrefixCount(pod=pod, prefix_chunks=n, tiers=tiers))
        return out

    async def holders(self, chunk_hashes: list[str]) -> dict[str, dict[str, int]]:
        now = self._clock()
        out: dict[str, dict[str, int]] = {}
        for chunk in chunk_hashes:
            for pod, mask in self._chunks.get(chunk, {}).items():
                if self._pods[pod].lease_expires_at > now:
                    out.setdefault(pod, {})[chunk] = mask
        return out

    async def pod_chunks(self, pod: str) -> dict[str, int]:
        return dict(self._live(pod).chunks)

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None


class _Session:
    def __init__(self, sid: str, parent: str | None, now: float) -> None:
        self.sid = sid
        self.parent = parent
        self.intents: dict[str, list[str]] = {}
        self.created_at = now
        self.updated_at = now
        self.expires_at: float | None = None
        self.pinned_until: float | None = None
        self.priority = DEFAULT_PRIORITY

    def life(self) -> SessionLife:
        return SessionLife(self.expires_at, self.pinned_until, self.priority)

    def info(self, now: float) -> SessionInfo:
        pinned = self.pinned_until if self.life().pinned(now) else None
        return SessionInfo(session_id=self.sid, parent=self.parent, intents=dict(self.intents),
                           created_at=self.created_at, updated_at=self.updated_at,
                           priority=self.priority, pinned_until=pinned,
                           expires_at=self.expires_at)


class InMemorySessionStore:
    """Sessions and their chunk references; ``_refs[chunk]`` is the set of sessions naming it."""

    def __init__(self, clock=time.time) -> None:  # type: ignore[no-untyped-def]
        self._clock = clock
        self._sessions: dict[str, _Session] = {}
        self._refs: dict[str, set[str]] = {}
        self._routes: dict[str, tuple[str, float | None]] = {}  # sid -> (record, expiry)
        # key -> (value, expiry), oldest written first: the count bound drops from the front
        self._responses: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def _live(self, sid: str, now: float) -> _Session | None:
        session = self._sessions.get(sid)
        if session is None or not session.life().live(now):
            return None
        return session

    def _session(self, sid: str, now: float) -> _Session:
        session = self._live(sid, now)
        if session is None:
            raise UnknownSession(sid)
        return session

    def _fresh(self, sid: str, parent: str | None, now: float) -> _Session:
        """A new session ``sid``; an expired one of that id not yet reaped is dropped first."""
        if sid in self._sessions:
            self._drop(sid)
        session = self._sessions[sid] = _Session(sid, parent, now)
        return session

    def _session_chunks(self, session: _Session) -> set[str]:
        return {c for chunks in session.intents.values() for c in chunks}

    def _set_intents(self, session: _Session, intents: dict[str, list[str]]) -> None:
        before = self._session_chunks(session)
        session.intents = intents
        after = self._session_chunks(session)
        for chunk in after - before:
            self._refs.setdefault(chunk, set()).add(session.sid)
        for chunk in before - after:
            holders = self._refs[chunk]
            holders.discard(session.sid)
            if not holders:
                del self._refs[chunk]

    def _touch(self, session: _Session, now: float, idle_ttl_s: float | None) -> SessionInfo:
        session.updated_at = now
        session.expires_at = session_expiry(now, idle_ttl_s, session.pinned_until)
        return session.info(now)

    def _drop(self, sid: str) -> list[str]:
        session = self._sessions[sid]
        chunks = sorted(self._session_chunks(session))
        self._set_intents(session, {})
        del self._sessions[sid]
        return chunks

    async def put_intent(self, session_id: str, intent: str, chunks: list[str],
                         idle_ttl_s: float | None = None) -> SessionInfo:
        now = self._clock()
        session = self._live(session_id, now) or self._fresh(session_id, None, now)
        self._set_intents(session, {**session.intents, intent: list(chunks)})
        return self._touch(session, now, idle_ttl_s)

    async def get_intent(self, session_id: str, intent: str) -> list[str]:
        session = self._session(session_id, self._clock())
        if intent not in session.intents:
            raise UnknownSession(session_id, intent)
        return list(session.intents[intent])

    async def delete_intent(self, session_id: str, intent: str,
                            idle_ttl_s: float | None = None) -> SessionInfo:
        now = self._clock()
        session = self._session(session_id, now)
        if intent not in session.intents:
            raise UnknownSession(session_id, intent)
        self._set_intents(session, {k: v for k, v in session.intents.items() if k != intent})
        return self._touch(session, now, idle_ttl_s)

    async def get_session(self, session_id: str) -> SessionInfo:
        now = self._clock()
        return self._session(session_id, now).info(now)

    async def close_session(self, session_id: str) -> list[str] | None:
        now = self._clock()
        self._routes.pop(session_id, None)
        if session_id not in self._sessions:
            return None
        live = self._live(session_id, now) is not None
        chunks = self._drop(session_id)
        return chunks if live else None

    async def fork(self, session_id: str, child: str,
                   idle_ttl_s: float | None = None) -> SessionInfo:
        now = self._clock()
        parent = self._session(session_id, now)
        if self._live(child, now) is not None:
            raise SessionExists(child)
        session = self._fresh(child, session_id, now)
        session.priority = parent.priority
        self._set_intents(session, dict(parent.intents))
        return self._touch(session, now, idle_ttl_s)

    async def pin(self, session_id: str, ttl_s: float,
                  idle_ttl_s: float | None = None) -> SessionInfo:
        now = self._clock()
        session = self._session(session_id, now)
        session.pinned_until = now + ttl_s
        return self._touch(session, now, idle_ttl_s)

    async def release(self, session_id: str, idle_ttl_s: float | None = None) -> SessionInfo:
        now = self._clock()
        session = self._session(session_id, now)
        session.pinned_until = None
        return self._touch(session, now, idle_ttl_s)

    async def set_priority(self, session_id: str, priority: int,
                           idle_ttl_s: float | None = None) -> SessionInfo:
        now = self._clock()
        session = self._session(session_id, now)
        session.priority = priority
        return self._touch(session, now, idle_ttl_s)

    async def references(self, chunk_hashes: list[str],
                         also: str | None = None) -> SessionRefs:
        out = SessionRefs(now=self._clock())
        for chunk in chunk_hashes:
            sids = self._refs.get(chunk)
            if sids:
                out.refs[chunk] = sorted(sids)
                for sid in sids:
                    out.sessions[sid] = self._sessions[sid].life()
        if also is not None and also in self._sessions:
            out.sessions[also] = self._sessions[also].life()
        return out

    async def expire_sessions(self) -> list[str]:
        now = self._clock()
        gone = sorted(sid for sid, s in self._sessions.items() if not s.life().live(now))
        for sid in gone:
            self._drop(sid)
        for sid in [sid for sid, (_, exp) in self._routes.items() if exp is not None
                    and exp <= now]:
            del self._routes[sid]
        for key in [key for key, (_, exp) in self._responses.items() if exp <= now]:
            del self._responses[key]
        return gone

    async def put_route(self, session_id: str, route: str, ttl_s: float | None = None
                        ) -> None:
        self._routes[session_id] = (route, None if ttl_s is None else self._clock() + ttl_s)

    async def get_route(self, session_id: str) -> str | None:
        route, expiry = self._routes.get(session_id, (None, None))
        return None if expiry is not None and expiry <= self._clock() else route

    async def put_stored_response(self, key: str, value: str, ttl_s: float,
                                  max_count: int) -> None:
        self._responses.pop(key, None)
        self._responses[key] = (value, self._clock() + ttl_s)
        while len(self._responses) > max_count:
            self._responses.popitem(last=False)

    async def get_stored_response(self, key: str) -> str | None:
        value, expiry = self._responses.get(key, (None, 0.0))
        return value if expiry > self._clock() else None

    async def delete_stored_response(self, key: str) -> bool:
        _, expiry = self._responses.pop(key, (None, 0.0))
        return expiry > self._clock()

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None
