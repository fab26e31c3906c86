"""How busy each decode pod's sessions keep it: where a new session should go.

A decode pod's load at the moment a session's first turn arrives (turns in flight, prompt
tokens queued) says little about the load it will carry: an agent session comes back every
few seconds for dozens of turns, each an append computed on the pod that holds its context,
and moving it costs a pull of that whole context. Placing new sessions by the momentary load
alone piles them up: on the mixed agent workload five of seven SWE agent sessions landed on
one decode pod (it happened to be between turns as each arrived, while the other computed a
chat's long first turn), which then ran 111 of 160 turns while the other ran 49.

Counting the sessions that last ran on each pod is not enough either: a chat that ended looks
like an agent between tool calls until a window passes. What predicts a pod's coming work is
the work it has been given: each turn placed on it, weighed as the proxy weighs load (a turn's
fixed share plus the prompt tokens it computes there) and decayed with ``half_life_s``. An
agent in its loop keeps its pod's level up; a finished chat fades from it within a few
half-lives. Turns, not work, were not enough: a pod whose sessions send long prompts places
fewer turns as it falls behind, so it looked the less active one and drew more sessions (on
the mixed workload one decode pod held 15 turns in flight, the other 2, and every new session
still went to the first). A turn counts when it is placed, not when it ends: in a burst of
arrivals each placement must be seen by the next, or every new session follows the first to
the pod that looked idle. A new session goes to the pod whose level plus momentary load is
lowest (``routing.LeastLoaded``). O(1) per turn.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable


class PodActivity:
    def __init__(self, half_life_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._rate = math.log(2) / half_life_s
        self._clock = clock
        self._level: dict[str, tuple[float, float]] = {}  # pod -> (level, as of when)

    def turn_placed(self, pod: str, work: float) -> None:
        self._level[pod] = (self.level(pod) + work, self._clock())

    def level(self, pod: str) -> float:
        """The work placed on ``pod``, each turn's weighing 1/2 per ``half_life_s`` since."""
        level, at = self._level.get(pod, (0.0, 0.0))
        return level * math.exp(-self._rate * (self._clock() - at)) if level else 0.0
