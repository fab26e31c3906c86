"""Turns announced before they arrive: seed 003's tool-call window on the scheduler's timeline.

When an agent's turn ends in a tool call, the proxy knows the session's next turn will come
back to this pod, roughly when (its tool-gap prediction), and which chunks its prefix will be
(the context just computed). It announces the turn (``POST /memory/prefetch`` with
``expected_in_s``) instead of reading the chunks at once: the ShadowScheduler then lets the turn
join its simulated queue at its predicted arrival, and its disk-only chunks move to DRAM only
when the turn is predicted for admission within the N+1 window. A read started at the tool
call would hold DRAM through the whole gap and could be evicted again before the turn is
admitted; one started after the arrival would be on the critical path.

This book is the announced turns' state, pure and clock-free (the caller passes ``now``):

- ``announce``: a turn due at ``eta`` whose prefix is ``hashes``;
- ``views``: the turns not yet arrived, as the ShadowScheduler's ``ReqView``s (their disk
  chunks read through ``tiers`` at the time of the step);
- ``arrived``: a waiting request whose prompt starts with an announced turn's chunks is that
  turn (chunk hashes chain the whole prefix, so the last one names it; the one before it too,
  as the context's last chunk may have been partial and is then rehashed once filled);
- ``due``: turns the scheduler has not stepped toward while the pod idles, to read one step
  ahead of their arrival (an idle vLLM scheduler does not step at all);
- ``expire``: a turn that never came (the session ended, its tool ran long) is dropped
  ``grace_s`` after its predicted arrival, and counted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from agentserving.core.schemas import Tier
from agentserving.prefill.policies.types import ReqView

from .shadow import EXPECTED


@dataclasses.dataclass
class AnnouncedTurn:
    key: str                  # the announcer's lookup id
    eta: float                # predicted arrival, on the caller's clock
    hashes: tuple[str, ...]   # the chunks of its prefix (the session's context so far)
    cached_tokens: int        # tokens those chunks hold
    new_tokens: int           # tokens it is expected to compute (its append)
    fired: bool = False       # its prefetch started (by the window or as ``due``)
    read: tuple[str, ...] = ()  # the disk-only chunks its prefetch asked for
    hold_until: float | None = None  # its KV is held (pinned) until then, on the caller's clock


@dataclasses.dataclass
class AnnouncedScore:
    """What became of the announced turns: arrived (matched to a real request), arrived after
    their prefetch started (the read ran before the turn existed), expired (never came)."""

    announced: int = 0
    arrived: int = 0
    prefetched_before_arrival: int = 0
    fired_by_window: int = 0
    fired_idle: int = 0
    expired: int = 0
    expired_after_prefetch: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class ExpectedTurns:
    def __init__(self, chunk_tokens: int, grace_s: float = 30.0, keep: int = 1024) -> None:
        self.chunk_tokens = max(1, chunk_tokens)
        self.grace_s = grace_s
        self.keep = keep
        self.turns: dict[str, AnnouncedTurn] = {}
        self._by_last: dict[str, str] = {}   # last prefix chunk -> key
        self.score = AnnouncedScore()

    def announce(self, key: str, eta: float, hashes: Sequence[str], new_tokens: int,
                 hold_until: float | None = None) -> None:
        """A re-announcement under the same key replaces the earlier one. ``hold_until``: the
        announcer holds the turn's KV until then, and its read is to be held as long."""
        if not hashes:
            return
        self._drop(key)
        while len(self.turns) >= self.keep:
            self._drop(next(iter(self.turns)))
        turn = AnnouncedTurn(key, eta, tuple(hashes), len(hashes) * self.chunk_tokens,
                             max(1, new_tokens), hold_until=hold_until)
        self.turns[key] = turn
        for h in turn.hashes[-2:]:
            self._by_last[h] = key
        self.score.announced += 1

    def views(self, tiers: Callable[[Sequence[str]], Sequence[Tier | None]]
              ) -> list[ReqView]:
        """Each pending turn as it would wait: its prefix cached, its disk-only chunks to
        prefetch (none once its prefetch started: it is not asked for twice)."""
        return [ReqView(EXPECTED + t.key, t.eta, t.cached_tokens + t.new_tokens,
                        computed=t.cached_tokens, disk_chunks=self._disk_only(t, tiers))
                for t in self.turns.values()]

    def disk_only(self, key: str, tiers: Callable[[Sequence[str]], Sequence[Tier | None]]
                  ) -> tuple[str, ...]:
        """The pending turn ``key``'s chunks on disk only (its view's ``disk_chunks``)."""
        return self._disk_only(self.turns[key], tiers)

    @staticmethod
    def _disk_only(t: AnnouncedTurn, tiers: Callable[[Sequence[str]], Sequence[Tier | None]]
                   ) -> tuple[str, ...]:
        if t.fired:
            return ()
        return tuple(h for h, tier in zip(t.hashes, tiers(t.hashes), strict=True)
                     if tier is Tier.DISK)

    def fire(self, key: str, by: str, read: Sequence[str]) -> AnnouncedTurn | None:
        """Mark ``key``'s prefetch started (``by``: "window" or "idle") for the chunks
        ``read``; None when it is no longer pending or already started."""
        turn = self.turns.get(key)
        if turn is None or turn.fired:
            return None
        turn.fired, turn.read = True, tuple(read)
        if by == "window":
            self.score.fired_by_window += 1
        else:
            self.score.fired_idle += 1
        return turn

    def arrived(self, hashes: Sequence[str]) -> AnnouncedTurn | None:
        """The announced turn a waiting request with these prompt chunks is, removed from the
        book (None: it was not announced)."""
        for h in reversed(hashes):
            key = self._by_last.get(h)
            if key is not None:
                turn = self._drop(key)
                assert turn is not None
                self.score.arrived += 1
                self.score.prefetched_before_arrival += turn.fired
                return turn
        return None

    def due(self, now: float, lead_s: float) -> list[str]:
        """Keys of pending turns not yet prefetched whose arrival is within ``lead_s``."""
        return [t.key for t in self.turns.values() if not t.fired and t.eta - lead_s <= now]

    def expire(self, now: float) -> list[str]:
        """Drop the turns ``grace_s`` past their arrival; their keys."""
        gone = [k for k, t in self.turns.items() if now > t.eta + self.grace_s]
        for k in gone:
            turn = self._drop(k)
            assert turn is not None
            self.score.expired += 1
            self.score.expired_after_prefetch += turn.fired
        return gone

    def _drop(self, key: str) -> AnnouncedTurn | None:
        turn = self.turns.pop(key, None)
        for h in turn.hashes[-2:] if turn is not None else ():
            if self._by_last.get(h) == key:
                del self._by_last[h]
        return turn
