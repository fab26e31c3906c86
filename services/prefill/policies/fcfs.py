"""First come, first served: without chunking (the baseline) and with a fixed chunk (Sarathi)."""

from __future__ import annotations

from agentserving.prefill.policies.base import Planner
from agentserving.prefill.policies.types import Decision, SchedState


class _Base:
    name = "base"
    chunk_align = 0
    timeline = True

    def decide(self, state: SchedState) -> Decision:
        p = Planner(state, self, timeline=self.timeline)
        self._plan(state, p)
        return p.finish()

    def decide_running(self, state: SchedState) -> tuple[Decision, bool]:
        p = Planner(state, self, timeline=False)
        self._plan(state, p)
        return p.finish(), p.stalled

    def _plan(self, state: SchedState, p: Planner) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


class FcfsNoChunk(_Base):
    """Whole prompts in arrival order. Each step runs the oldest prompt whole, plus the next
    ones while they fit ``step_tokens`` together; a long prompt blocks everything behind it."""

    name = "fcfs-nochunk"

    def __init__(self, step_tokens: int = 8192, chunk_align: int = 0) -> None:
        self.step_tokens = step_tokens
        self.chunk_align = chunk_align

    def _plan(self, state: SchedState, p: Planner) -> None:
        used = 0
        for r in sorted((r for r in state.running if r.prefilling), key=lambda x: x.arrival):
            if used and used + r.remaining > self.step_tokens:
                return
            used += p.grant(r, r.remaining)
        for w in state.waiting:
            if used and used + w.remaining > self.step_tokens:
                return
            n = p.admit(w, w.remaining)
            if n == 0:
                return  # strict FCFS: the head blocks the queue
            used += n


class FcfsChunk(_Base):
    """Sarathi-style chunked prefill: a fixed budget of ``chunk_tokens`` per step, filled
    oldest first (requests already prefilling before new admissions)."""

    name = "fcfs-chunk"

    def __init__(self, chunk_tokens: int = 512, chunk_align: int = 0) -> None:
        if chunk_tokens < chunk_align:  # no aligned chunk would ever fit: a stall
            raise ValueError(f"chunk_tokens ({chunk_tokens}) must be >= chunk_align "
                             f"({chunk_align})")
        self.chunk_tokens = chunk_tokens
        self.chunk_align = chunk_align

    def _plan(self, state: SchedState, p: Planner) -> None:
        left = self.chunk_tokens
        for r in sorted((r for r in state.running if r.prefilling), key=lambda x: x.arrival):
            left -= p.grant(r, left)
        for w in state.waiting:
            if left <= 0:
                return
            n = p.admit(w, left)
            if n == 0:
                return
            left -= n
