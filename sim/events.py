"""The event engine: a clock and a heap of callbacks.

Ordering contract: events run in time order; events at the same time run in the order they
were scheduled (FIFO), so a run is a pure function of its inputs. A handle can be cancelled
(the event is skipped when popped), which is how a pod reschedules its next completion.
The heap holds ``(time, seq, event)`` tuples: compared in C, where an ``Event.__lt__`` call per
comparison was ~2% of a large run; ``seq`` is unique, so no two entries compare their events.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any


class Event:
    __slots__ = ("time", "seq", "fn", "args", "cancelled")

    def __init__(self, time: float, seq: int, fn: Callable[..., Any], args: tuple) -> None:
        self.time, self.seq, self.fn, self.args = time, seq, fn, args
        self.cancelled = False

    def __lt__(self, other: Event) -> bool:
        return (self.time, self.seq) < (other.time, other.seq)

    def cancel(self) -> None:
        self.cancelled = True


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Event]] = []
        self._seq = itertools.count()
        self.processed = 0

    def at(self, time: float, fn: Callable[..., Any], *args: Any) -> Event:
        if time < self.now:
            raise ValueError(f"cannot schedule in the past ({time} < {self.now})")
        seq = next(self._seq)
        ev = Event(time, seq, fn, args)
        heapq.heappush(self._heap, (time, seq, ev))
        return ev

    def after(self, delay: float, fn: Callable[..., Any], *args: Any) -> Event:
        return self.at(self.now + max(0.0, delay), fn, *args)

    def run(self, until: float | None = None) -> None:
        heap = self._heap
        pop = heapq.heappop
        while heap:
            if until is not None and heap[0][0] > until:
                self.now = until
                return
            ev = pop(heap)[2]
            if ev.cancelled:
                continue
            self.now = ev.time
            self.processed += 1
            ev.fn(*ev.args)

    def __len__(self) -> int:
        return sum(1 for _, _, e in self._heap if not e.cancelled)


def run_sync(coro: Any) -> Any:
    """Run a coroutine that never awaits anything pending (the in-memory kvindex backends)
    to completion without an event loop."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("coroutine suspended: only non-blocking coroutines can be run here")
