"""Stall deadlines: how long a pod may go silent before its turn moves to another pod.

A dead pod refuses connections and its turn fails over at once; a stalled one (a stopped
process, a wedged engine, a node swapping) accepts the request and says nothing, and without a
deadline the turn waits out ``--upstream-timeout``. Each stage has two deadlines: the first
token (the prefill stage: a pod computing the prompt, the P/D prefill call or a turn run
whole; the decode stage: a decode pod's first token after its KV pull) and the gap between
two tokens of a stream.

A deadline set by flag is used as it is. Unset, it follows the pods' own latency: a multiple
(``--stall-multiple``) of the P99 of the last ``WINDOW`` observations, never below a floor;
until ``--stall-min-samples`` observations a fixed initial value applies. The P99 moves with
the load (a busy pool's first tokens come later), so a pod is called stalled only when it is
far slower than its pool has recently been. Pure: the orchestrator feeds it observations and
asks it for deadlines; it keeps no clock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agentserving.proxy.settings import ProxySettings

STAGES = ("prefill", "decode")
KINDS = ("first_token", "inter_token")
WINDOW = 512


@dataclass(frozen=True)
class StallPolicy:
    """The knobs of ``--stall-*``: fixed deadlines (None: adaptive) and the adaptive rule."""

    fixed: dict[tuple[str, str], float | None]
    multiple: float = 5.0
    floor_s: dict[str, float] | None = None  # per kind
    initial_s: dict[str, float] | None = None  # per kind, before min_samples
    min_samples: int = 20


class LatencyWindow:
    """The last ``WINDOW`` observations of one latency, with their P99 (recomputed every few
    observations: a turn asks for a deadline, it must not sort the window each time)."""

    def __init__(self, size: int = WINDOW) -> None:
        self._values: deque[float] = deque(maxlen=size)
        self._p99: float | None = None
        self._stale = 0

    def __len__(self) -> int:
        return len(self._values)

    def observe(self, seconds: float) -> None:
        self._values.append(seconds)
        self._stale += 1

    def p99(self) -> float | None:
        if not self._values:
            return None
        if self._p99 is None or self._stale >= 8:
            ordered = sorted(self._values)
            self._p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
            self._stale = 0
        return self._p99


def adaptive_deadline(p99: float | None, samples: int, multiple: float, floor_s: float,
                      initial_s: float, min_samples: int) -> float:
    """The deadline for one latency: ``initial_s`` until ``min_samples`` observations, then
    ``multiple`` x P99, never under ``floor_s``."""
    if p99 is None or samples < min_samples:
        return initial_s
    return max(floor_s, multiple * p99)


class StallDeadlines:
    """Per (stage, kind): the deadline in force, from a flag or the observed latencies."""

    def __init__(self, policy: StallPolicy) -> None:
        self.policy = policy
        self._windows = {(s, k): LatencyWindow() for s in STAGES for k in KINDS}

    def observe(self, stage: str, kind: str, seconds: float) -> None:
        self._windows[(stage, kind)].observe(seconds)

    def deadline(self, stage: str, kind: str) -> float:
        fixed = self.policy.fixed.get((stage, kind))
        if fixed is not None:
            return fixed
        window = self._windows[(stage, kind)]
        return adaptive_deadline(window.p99(), len(window), self.policy.multiple,
                                 (self.policy.floor_s or {}).get(kind, 1.0),
                                 (self.policy.initial_s or {}).get(kind, 30.0),
                                 self.policy.min_samples)

    def samples(self, stage: str, kind: str) -> int:
        return len(self._windows[(stage, kind)])


def policy_from(settings: ProxySettings) -> StallPolicy:
    return StallPolicy(
        fixed={("prefill", "first_token"): settings.stall_prefill_first_token_s,
               ("prefill", "inter_token"): settings.stall_prefill_inter_token_s,
               ("decode", "first_token"): settings.stall_decode_first_token_s,
               ("decode", "inter_token"): settings.stall_decode_inter_token_s},
        multiple=settings.stall_multiple,
        floor_s={"first_token": settings.stall_first_token_floor_s,
                 "inter_token": settings.stall_inter_token_floor_s},
        initial_s={"first_token": settings.stall_first_token_initial_s,
                   "inter_token": settings.stall_inter_token_initial_s},
        min_samples=settings.stall_min_samples)
