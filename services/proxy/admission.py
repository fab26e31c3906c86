"""Admission at the fleet's door: the turn with the fewest prompt tokens to compute goes first.

A pod's engine serves the prompts queued on it in arrival order, so on a burst of first turns
the median turn waits for half the burst, and a session's short append behind them too. Seed
003's Longcap serves short prompts first inside one prefill node; the proxy does the same over
the whole fleet: once every pod already has ``per_pod`` prompts it is computing (a turn run
whole until its first token, a P/D turn until its prefill pod answers), a new turn waits here,
and each freed place goes to the waiting turn with the fewest tokens to compute. A turn that
has waited ``max_wait_s`` goes first, so a stream of short turns cannot starve a long one.
Turns are routed after they are admitted, to the pods' load at that moment. (A place kept for
the oldest long prompt, so that the longest do not all finish last, was measured and did not
pay: docs/replay.md.)

The gate also looks ahead: a waiting turn is told once it is among those that take the next
rounds of places (``upcoming``, the same order), so that its KV can be read while it waits
(the proxy's ``--queued-prefetch``).

The choice is pure (``next_waiter``, ``upcoming``); ``AdmissionGate`` is the thin asyncio layer
around it.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum


class Admitted(StrEnum):
    FREE = "free"  # a place was free on arrival
    SHORTEST = "shortest"  # the fewest tokens among those waiting
    AGED = "aged"  # waited past max_wait_s


@dataclass
class Waiter:
    cost: int  # prompt tokens the turn is expected to compute
    since: float  # when it began to wait (the gate's clock)
    seq: int  # arrival order: ties go to the earlier turn
    future: asyncio.Future = field(repr=False, compare=False)
    # called when the turn is among the next to take a place (``upcoming``), and again if it
    # still waits ``retell_s`` later
    on_next: Callable[[], None] | None = field(default=None, repr=False, compare=False)
    told_at: float | None = None


def next_waiter(waiters: Sequence[Waiter], now: float, max_wait_s: float
                ) -> tuple[int, Admitted] | None:
    """Which waiting turn takes a freed place: the earliest of those waiting ``max_wait_s`` or
    longer, else the one with the fewest tokens to compute (the earlier on a tie)."""
    first = upcoming(waiters, now, max_wait_s, 1)
    if not first:
        return None
    i = first[0]
    return i, Admitted.AGED if now - waiters[i].since >= max_wait_s else Admitted.SHORTEST


def upcoming(waiters: Sequence[Waiter], now: float, max_wait_s: float, k: int) -> list[int]:
    """The ``k`` waiting turns that would take the next ``k`` freed places, in order, as
    ``next_waiter`` picks them now: those waiting ``max_wait_s`` or longer by arrival, then
    the fewest tokens to compute."""
    aged = [i for i, w in enumerate(waiters) if now - w.since >= max_wait_s]
    rest = [i for i, w in enumerate(waiters) if now - w.since < max_wait_s]
    aged.sort(key=lambda i: waiters[i].seq)
    rest.sort(key=lambda i: (waiters[i].cost, waiters[i].seq))
    return (aged + rest)[:max(0, k)]


class Ticket:
    """A turn's place among the prompts being computed; ``release()`` (idempotent) frees it for
    the next waiting turn once the prompt is computed (or the turn has ended)."""

    def __init__(self, gate: AdmissionGate, how: Admitted, waited_s: float) -> None:
        self._gate: AdmissionGate | None = gate
        self.how, self.waited_s = how, waited_s

    def release(self) -> None:
        if self._gate is not None:
            gate, self._gate = self._gate, None
            gate._release()


class AdmissionGate:
    def __init__(self, per_pod: int, max_wait_s: float, pods: Callable[[], int],
                 clock: Callable[[], float] = time.monotonic, lookahead: int = 2,
                 age_lead_s: float = 2.0, retell_s: float = 10.0) -> None:
        """``lookahead``: a waiting turn is told it is next (its ``on_next``) once it is
        among those that take the next ``lookahead`` rounds of places (the places of every
        pod, freed once each; 0: never told), a turn about to have waited ``max_wait_s``
        counted as having waited so ``age_lead_s`` ahead (it goes first then, past every
        shorter one); told, and still waiting ``retell_s`` later (shorter turns came), it is
        told again."""
        self.per_pod, self.max_wait_s, self.lookahead = per_pod, max_wait_s, lookahead
        self.age_lead_s, self.retell_s = age_lead_s, retell_s
        self._pods, self._clock = pods, clock
        self._waiters: list[Waiter] = []
        self._seq = itertools.count()
        self.admitted = 0  # tickets out

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def capacity(self) -> int:
        return self.per_pod * max(1, self._pods())

    async def admit(self, cost: int, on_next: Callable[[], None] | None = None) -> Ticket:
        """Waits, if every place is taken, until this turn is the one to go; ``on_next()``
        once it is among the next to go (``lookahead``), never if it goes at once."""
        if not self._waiters and self.admitted < self.capacity():
            self.admitted += 1
            return Ticket(self, Admitted.FREE, 0.0)
        waiter = Waiter(max(0, cost), self._clock(), next(self._seq),
                        asyncio.get_running_loop().create_future(), on_next)
        self._waiters.append(waiter)
        self._admit_waiters()  # the pods may have grown since the last release
        try:
            how = await waiter.future
        except asyncio.CancelledError:  # the caller went away while waiting
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            elif waiter.future.done() and not waiter.future.cancelled():
                self._release()  # it had been given a place: pass the place on
            raise
        return Ticket(self, how, self._clock() - waiter.since)

    def _release(self) -> None:
        self.admitted = max(0, self.admitted - 1)
        self._admit_waiters()

    def _admit_waiters(self) -> None:
        while self.admitted < self.capacity():
            chosen = next_waiter(self._waiters, self._clock(), self.max_wait_s)
            if chosen is None:
                return
            i, how = chosen
            waiter = self._waiters.pop(i)
            if waiter.future.done():  # cancelled meanwhile
                continue
            self.admitted += 1
            waiter.future.set_result(how)
        self._tell_upcoming()

    def _tell_upcoming(self) -> None:
        now, k = self._clock(), self.lookahead * self.capacity()
        if k <= 0:  # not looking ahead: no order to work out
            return
        for i in upcoming(self._waiters, now + self.age_lead_s, self.max_wait_s, k):
            waiter = self._waiters[i]
            if waiter.on_next is not None and (
                    waiter.told_at is None or now - waiter.told_at >= self.retell_s):
                waiter.told_at = now
                waiter.on_next()
