"""What the proxy remembers of each session between turns: the chunk hashes the engine
returned for the previous turn (to route the next one), where it ran, and tool-gap timing.

A bounded LRU whose entries also lapse idle (``idle_ttl_s`` after their last turn, as the
kvindex's sessions do) and go when their session closes; keys include the tenant, so one
tenant cannot steer by another's session. Without the lapse a long-running proxy kept every
session it ever saw, up to ``max_sessions`` (``bench/soak_bench.py``).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from agentserving.core.schemas import SessionRoute
from agentserving.proxy.disagg import HeldContext


@dataclass
class SessionState:
    chunk_hashes: list[str] = field(default_factory=list)
    last_pod: str | None = None
    last_decode_pod: str | None = None  # P/D: it holds the session's chunks from last turn
    prompt_tokens: int | None = None  # the previous turn's prompt, from its usage
    prompt_chars: int | None = None  # ... and its size in characters (text prompts)
    turns: int = 0
    last_turn_end: float | None = None
    pending_tool: str | None = None  # the tool the previous turn called
    predicted_gap_s: float | None = None
    prefetch_fired_at: float | None = None
    # where the pods found the session's KV when its next turn was announced (prefetch_found)
    kv_at_announce: dict[str, int] | None = None

    def held(self, chunk_size: int) -> HeldContext | None:
        """What the session's previous turn left on its own pod (None: nothing known)."""
        if self.prompt_tokens is None:
            return None
        return HeldContext(self.prompt_tokens, self.prompt_chars, chunk_size)

    def fork_from(self, parent: SessionState) -> None:
        """A branch starts where its parent is: the same chunks (copy-on-write in the
        kvindex), pods and previous prompt, so its first turn routes as the parent's next."""
        self.chunk_hashes = list(parent.chunk_hashes)
        self.last_pod, self.last_decode_pod = parent.last_pod, parent.last_decode_pod
        self.prompt_tokens, self.prompt_chars = parent.prompt_tokens, parent.prompt_chars

    # The routing fields above, as every proxy replica shares them (--shared-sessions); the
    # tool-gap fields stay with the replica (monotonic times, this process's predictor).
    def route(self) -> SessionRoute:
        return SessionRoute(turns=self.turns, chunk_hashes=self.chunk_hashes,
                            last_pod=self.last_pod, last_decode_pod=self.last_decode_pod,
                            prompt_tokens=self.prompt_tokens, prompt_chars=self.prompt_chars)

    def adopt(self, route: SessionRoute) -> None:
        self.turns, self.chunk_hashes = route.turns, list(route.chunk_hashes)
        self.last_pod, self.last_decode_pod = route.last_pod, route.last_decode_pod
        self.prompt_tokens, self.prompt_chars = route.prompt_tokens, route.prompt_chars


class SessionTable:
    def __init__(self, max_sessions: int, idle_ttl_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._max = max_sessions
        self._idle_ttl_s = idle_ttl_s or None
        self._clock = clock
        self._items: OrderedDict[str, SessionState] = OrderedDict()
        self._used: dict[str, float] = {}  # key -> when it was last got, in LRU order too

    def get(self, key: str) -> SessionState:
        now = self._clock()
        self._lapse(now)
        state = self._items.get(key)
        if state is None:
            state = self._items[key] = SessionState()
            while len(self._items) > self._max:
                self._drop(next(iter(self._items)))
        else:
            self._items.move_to_end(key)
        self._used[key] = now
        return state

    def peek(self, key: str) -> SessionState | None:
        return self._items.get(key)

    def forget(self, key: str) -> None:
        """The session closed: nothing of it is worth keeping."""
        self._drop(key)

    def _lapse(self, now: float) -> None:
        """Drop the least recently used sessions idle for longer than the TTL (the front of
        the LRU order: amortized O(1) per call)."""
        if self._idle_ttl_s is None:
            return
        while self._items:
            oldest = next(iter(self._items))
            if now - self._used.get(oldest, now) <= self._idle_ttl_s:
                return
            self._drop(oldest)

    def _drop(self, key: str) -> None:
        self._items.pop(key, None)
        self._used.pop(key, None)

    def __len__(self) -> int:
        return len(self._items)


def session_key(tenant: str | None, session_id: str | None) -> str | None:
    if session_id is None:
        return None
    return f"{tenant or '-'}/{session_id}"


def kvindex_session_id(session_id: str | None) -> str | None:
    """The id a client's session goes by in the kvindex, whose ids hold no '/' (a segment of
    its REST paths): '%' written %25 and '/' %2F, so two ids stay two and an id with neither
    is its own. A replay's ``mooncake/mc6859`` is ``mooncake%2Fmc6859`` there."""
    if session_id is None:
        return None
    return session_id.replace("%", "%25").replace("/", "%2F")
