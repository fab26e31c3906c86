"""One pod's KV tiers (device prefix cache, CPU DRAM, local disk) as exclusive LRU lists of
chunk ids, reporting residency changes to the kvindex the way a worker does (event batches).

Simplifications (docs/sim.md): a chunk lives in exactly one tier; eviction demotes device ->
DRAM -> disk -> gone; a hit is promoted to the device tier. Every move is counted as
transfer volume of its kind. A pinned chunk (a prefetch waiting for its turn's admission) stays
in its tier, outside the LRU order, and counts against the tier's size until it is unpinned.
``DiskReads`` times the prefetches: one disk queue, each chunk landing when its read ends.

Speed: a 100k-session run makes ~10^8 residency changes, so the per-change paths (``_place``'s
eviction cascade, ``store``, ``use``) are written as flat loops over local names, with no call
per change; ``log`` (tests) records the raw change sequence they net.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

from agentserving.core.schemas import EventBatch, EventOp, ResidencyEvent, Tier

TIERS = (Tier.DEVICE, Tier.CPU, Tier.DISK)
_DEMOTE = {Tier.DEVICE: Tier.CPU, Tier.CPU: Tier.DISK}
_MOVE_KIND = {(Tier.DEVICE, Tier.CPU): "device_to_dram", (Tier.CPU, Tier.DISK): "dram_to_disk",
              (Tier.CPU, Tier.DEVICE): "dram_to_device", (Tier.DISK, Tier.CPU): "disk_to_dram",
              (Tier.DISK, Tier.DEVICE): "disk_to_device"}
_STORED, _REMOVED = EventOp.STORED, EventOp.REMOVED
_DEVICE, _CPU, _DISK = Tier.DEVICE, Tier.CPU, Tier.DISK


class PodTiers:
    def __init__(self, pod: str, caps: dict[Tier, int], chunk_bytes: int,
                 log: list[tuple[EventOp, Tier, str]] | None = None) -> None:
        self.pod = pod
        self.caps = caps                       # chunks per tier (0: no such tier)
        self.lru: dict[Tier, OrderedDict[str, None]] = {t: OrderedDict() for t in TIERS}
        self.where: dict[str, Tier] = {}
        self.chunk_bytes = chunk_bytes
        self.moved: dict[str, int] = {}        # kind -> bytes
        # changes since the last flush, netted per (chunk, tier): the last op wins, which is
        # what applying the raw ops in order leaves in the index (a tier is one bit of a chunk's
        # mask, independent of the others); ``raw_events`` counts the ops before netting
        self._net: dict[tuple[str, Tier], EventOp] = {}
        self.raw_events = 0
        self.flushed_raw = 0                   # raw_events at the last flush
        self.seq = 0
        self.log = log                         # if a list: every raw (op, tier, chunk) change
        # where a chunk placed in a tier lands: that tier, else the first one below it that
        # exists (a decode pod, or a pod without a device prefix cache: DRAM); None: nowhere
        self._land: dict[Tier, Tier | None] = {}
        for t in TIERS:
            land: Tier | None = t
            while land is not None and caps.get(land, 0) <= 0:
                land = _DEMOTE.get(land)
            self._land[t] = land
        # where a chunk evicted from a tier goes: the tier right below, if it exists (an
        # eviction never skips a missing tier: with no DRAM, device victims are dropped)
        self._below = {t: (_DEMOTE[t] if t in _DEMOTE and caps.get(_DEMOTE[t], 0) > 0
                           else None) for t in TIERS}
        # per tier, what its eviction cascade reads: (LRU, capacity, tier below, move kind)
        self._levels = {t: (self.lru[t], caps.get(t, 0), self._below[t],
                            _MOVE_KIND.get((t, self._below[t]))) for t in TIERS}
        self.top = self._land[Tier.DEVICE]     # where a new or promoted chunk lands
        self.pinned: dict[str, Tier] = {}      # chunk -> its tier (outside that tier's LRU)

    # -- queries
    def prefix(self, chunks: list[str], limit: int) -> tuple[int, list[Tier]]:
        tiers = []
        where = self.where
        for h in chunks[:limit]:
            t = where.get(h)
            if t is None:
                break
            tiers.append(t)
        return len(tiers), tiers

    def prefix_len(self, chunks: list[str], limit: int) -> int:
        """``prefix(...)[0]`` without the tier list."""
        where = self.where
        n = 0
        for h in chunks:
            if n >= limit or h not in where:
                break
            n += 1
        return n

    def count(self, tier: Tier) -> int:
        return len(self.lru[tier])

    # -- changes
    def _note(self, op: EventOp, tier: Tier, h: str) -> None:
        self._net[(h, tier)] = op
        self.raw_events += 1
        if self.log is not None:
            self.log.append((op, tier, h))

    def _remove(self, h: str) -> Tier | None:
        t = self.where.pop(h, None)
        if t is not None:
            if h in self.pinned:
                self._release(h, t)
            else:
                del self.lru[t][h]
            self._note(_REMOVED, t, h)
        return t

    def _place(self, h: str, tier: Tier) -> None:
        """Put ``h`` (held nowhere) at the head of ``tier`` (or the first tier below that
        exists); each tier it overflows evicts its least recently used chunk one tier down
        (or out). The same changes, in the same order, as placing each victim recursively."""
        land = self._land[tier]
        if land is None:
            return
        tier = land
        where, net, levels, log = self.where, self._net, self._levels, self.log
        raw = 0
        while True:
            q, cap, lower, kind = levels[tier]
            q[h] = None
            where[h] = tier
            net[(h, tier)] = _STORED
            raw += 1
            if log is not None:
                log.append((_STORED, tier, h))
            if len(q) <= cap:   # at most one over: every placed chunk was held nowhere
                break
            victim = q.popitem(last=False)[0]
            del where[victim]
            net[(victim, tier)] = _REMOVED
            raw += 1
            if log is not None:
                log.append((_REMOVED, tier, victim))
            if lower is None:
                break
            self.moved[kind] = self.moved.get(kind, 0) + self.chunk_bytes
            h, tier = victim, lower
        self.raw_events += raw

    def _count(self, src: Tier, dst: Tier) -> None:
        kind = _MOVE_KIND[(src, dst)]
        self.moved[kind] = self.moved.get(kind, 0) + self.chunk_bytes

    def store(self, chunks: list[str]) -> None:
        """Newly computed KV for ``chunks`` (on the device): keep it, most recent first."""
        top = self.top
        where, lru = self.where, self.lru
        for h in chunks:
            t = where.get(h)
            if t is _DEVICE or (t is not None and t is top):
                try:
                    lru[t].move_to_end(h)      # _refresh, inlined
                except KeyError:               # pinned: its place is kept until unpinned
                    pass
            else:
                if t is not None:
                    self._remove(h)
                self._place(h, _DEVICE)

    def _refresh(self, h: str, t: Tier) -> None:
        """A chunk stored or reused in the tier it would land in anyway (a decode pod's DRAM):
        it becomes the most recently used, as on the device tier, and nothing else changes —
        no eviction (the tier's size is the same) and no residency event (the engine's tiers
        report none for a hit; the index would have applied a STORED on a bit already set).
        (Inlined in ``store`` and ``use``.)"""
        self.lru[t].move_to_end(h)

    def store_new(self, chunks: list[str]) -> int:
        """``store``, returning how many of ``chunks`` were not held in any tier before it
        (what an engine actually writes; storing the first may evict a later one)."""
        where = self.where
        n = sum(1 for h in chunks if h not in where)
        self.store(chunks)
        return n

    def use(self, chunks: list[str]) -> dict[Tier, int]:
        """A request reuses ``chunks``: promote them to the device; returns chunks per source."""
        src: dict[Tier, int] = {}
        where, lru, top = self.where, self.lru, self.top
        for h in chunks:
            t = where.get(h)
            if t is None:
                continue
            src[t] = src.get(t, 0) + 1
            if t is not _DEVICE:
                self._count(t, _DEVICE)
            if t is _DEVICE or t is top:
                try:
                    lru[t].move_to_end(h)      # _refresh, inlined
                except KeyError:               # pinned
                    pass
                continue
            self._remove(h)
            self._place(h, _DEVICE)
        return src

    def prefetch(self, chunks: tuple[str, ...] | list[str]) -> int:
        """Disk -> DRAM for the chunks still on disk, every read landing at once (``land``;
        the pods time theirs with ``DiskReads``); returns how many moved."""
        where = self.where
        return sum(self.land(h) for h in chunks if where.get(h) is _DISK)

    def place(self, chunks: list[str] | tuple[str, ...], tier: Tier) -> None:
        """Chunks held nowhere yet start in ``tier`` (a pod's starting state: contexts already
        on disk); chunks held anywhere are left as they are."""
        for h in chunks:
            if h not in self.where:
                self._place(h, tier)

    def land(self, h: str) -> bool:
        """A read of ``h`` from disk finished: it is in DRAM, most recently used (a chunk
        already there is refreshed, a pinned one keeps its place); False if ``h`` is held
        nowhere (nothing was read) or the pod has no DRAM."""
        t = self.where.get(h)
        if t is _DISK and self.caps.get(_CPU, 0) > 0:
            self._remove(h)
            self._count(_DISK, _CPU)
            self._place(h, _CPU)
            return True
        if t is _CPU:
            if h not in self.pinned:
                self.lru[_CPU].move_to_end(h)
            return True
        return False

    def pin(self, h: str) -> bool:
        """Keep ``h`` where it is until ``unpin``: out of its tier's LRU order (never a
        victim), still counted against the tier's size. False if ``h`` is held nowhere."""
        t = self.where.get(h)
        if t is None or h in self.pinned:
            return t is not None
        del self.lru[t][h]
        self.pinned[h] = t
        self._resize(t, -1)
        return True

    def unpin(self, h: str) -> None:
        """``h`` rejoins its tier's LRU as the most recently used chunk (the tier's size is
        unchanged, so nothing is evicted)."""
        t = self.pinned.get(h)
        if t is not None:
            self._release(h, t)
            self.lru[t][h] = None

    def _release(self, h: str, t: Tier) -> None:
        del self.pinned[h]
        self._resize(t, +1)

    def _resize(self, t: Tier, by: int) -> None:
        """The room ``t``'s LRU has: its size less the chunks pinned in it."""
        q, cap, lower, kind = self._levels[t]
        self._levels[t] = (q, cap + by, lower, kind)

    def flush(self) -> EventBatch | None:
        """The residency changes since the last flush as one worker event batch: one event per
        (op, tier), its chunks in the order they first changed.

        Netting per (chunk, tier) leaves the index with exactly the masks (and per-tier counts)
        the raw op sequence would, so every later lookup — the only thing routing reads — is
        the same; it only saves the index redundant work. model_construct: the inputs are valid
        by construction (enum members, the workload's chunk ids, a registered pod name) and
        validating them was the largest cost of a run (tests check validation accepts them).
        """
        if not self._net:
            return None
        self.seq += 1
        groups: dict[tuple[EventOp, Tier], list[str]] = {}
        for (h, tier), op in self._net.items():
            hs = groups.get((op, tier))
            if hs is None:
                groups[(op, tier)] = [h]
            else:
                hs.append(h)
        self._net = {}
        make = ResidencyEvent.model_construct
        events = [make(op=op, tier=tier, chunk_hashes=hs, bytes=None)
                  for (op, tier), hs in groups.items()]
        return EventBatch.model_construct(pod=self.pod, seq=self.seq, events=events)


class DiskReads:
    """The pod's prefetch reads from disk, timed: one queue, ``disk_s`` seconds a chunk, each
    chunk landing in DRAM (``PodTiers.land``) when its read ends, so it can still be evicted
    between landing and its turn's admission unless it is pinned. A pin is granted at landing
    while fewer than ``pin_share`` of DRAM's chunks are pinned; a chunk past that joins the
    LRU. Landings are applied lazily, in landing order, by ``settle(now)``.

    What the caller's side of a prefetch rests on (the scheduling bench's survival and
    consumption): ``landing`` says when a chunk still in flight arrives, so an admission can
    wait for it instead of reading it from disk a second time."""

    def __init__(self, tiers: PodTiers, disk_s: float, pin_share: float = 0.75) -> None:
        self.tiers = tiers
        self.disk_s = disk_s
        self.pin_cap = int(tiers.caps.get(_CPU, 0) * pin_share)
        self.free_at = 0.0                             # when the disk queue is next idle
        self._arrive: dict[str, float] = {}            # chunk in flight -> its landing time
        self._heap: list[tuple[float, str]] = []       # (landing time, chunk)
        self._pin_wanted: set[str] = set()

    def prefetch(self, chunks: tuple[str, ...], now: float, pin: bool = False) -> None:
        """Queue reads of ``chunks`` behind the reads already queued; with ``pin``, each is
        pinned when it lands (if the pin share allows) until ``unpin``. A chunk asked for
        again lands at its new time only."""
        start = max(now, self.free_at)
        for i, h in enumerate(chunks):
            land = start + (i + 1) * self.disk_s
            self._arrive[h] = land
            heapq.heappush(self._heap, (land, h))
        if pin:
            self._pin_wanted.update(chunks)
        self.free_at = start + len(chunks) * self.disk_s

    def settle(self, now: float) -> None:
        """Land every read due by ``now``, in landing order."""
        heap, arrive, tiers = self._heap, self._arrive, self.tiers
        while heap and heap[0][0] <= now:
            land, h = heapq.heappop(heap)
            if arrive.get(h) != land:
                continue                               # superseded by a later request
            del arrive[h]
            tiers.land(h)
            if h in self._pin_wanted and len(tiers.pinned) < self.pin_cap:
                tiers.pin(h)

    def landing(self, h: str) -> float | None:
        """When ``h``'s read lands (None: not in flight); as of the last ``settle``."""
        return self._arrive.get(h)

    def unpin(self, chunks: tuple[str, ...]) -> None:
        """The turn these were prefetched for was admitted: they are plain LRU entries again
        (and a read still in flight lands unpinned)."""
        for h in chunks:
            self._pin_wanted.discard(h)
            self.tiers.unpin(h)
