"""The straightforward planner, as first written (``dataclasses.replace`` per grant, the full
banker's loop on every check): the reference the fast ``policies.base.Planner`` must match
decision for decision (``test_planner_speedup.py``). Test-only; not imported by the package."""

from __future__ import annotations

import dataclasses
from typing import Any

from agentserving.prefill.policies.base import max_advance
from agentserving.prefill.policies.types import Decision, ReqView, SchedState


def ref_advance(state: SchedState, decision: Decision, *, drop_finished: bool = True) -> SchedState:
    """The state after ``decision`` runs (no new arrivals): prompts advance, decodes grow by one
    token, requests with nothing left to do release their KV."""
    by_id = {r.req_id: r for r in state.running}
    admitted = set(decision.admit)
    waiting = []
    for r in state.waiting:
        if r.req_id in admitted:
            by_id[r.req_id] = dataclasses.replace(r, running=True)
        else:
            waiting.append(r)
    for rid, n in decision.prefill:
        r = by_id[rid]
        by_id[rid] = dataclasses.replace(r, computed=r.computed + n)
    for rid in decision.decode:
        r = by_id[rid]
        by_id[rid] = dataclasses.replace(r, computed=r.computed + 1, decode_left=r.decode_left - 1)
    running = tuple(r for r in by_id.values()
                    if not drop_finished or r.prefilling or r.decode_left > 0)
    return dataclasses.replace(state, waiting=tuple(waiting), running=running)


def reserved_blocks(state: SchedState, r: ReqView) -> int:
    if r.running and r.remaining == 0:
        return state.blocks(r.peak_tokens)
    return state.blocks(r.computed) if r.running else 0


def need_blocks(state: SchedState, r: ReqView) -> int:
    return state.blocks(r.peak_tokens) - reserved_blocks(state, r)


def ref_is_safe(state: SchedState, running: tuple[ReqView, ...] | None = None) -> bool:
    running = state.running if running is None else running
    free = state.capacity_blocks - sum(reserved_blocks(state, r) for r in running)
    if free < 0:
        return False
    for r in sorted(running, key=lambda x: need_blocks(state, x)):
        need = need_blocks(state, r)
        if need > free:
            return False
        free += reserved_blocks(state, r)
    return True


def free_tokens(state: SchedState) -> int:
    used = sum(reserved_blocks(state, r) for r in state.running)
    return (state.capacity_blocks - used) * state.block_size


class RefPlanner:
    """Builds one step's decision grant by grant, keeping it legal and safe."""

    def __init__(self, state: SchedState, policy: Any, *, timeline: bool = True) -> None:
        self.state = state
        self.policy = policy
        self.timeline = timeline
        self.views = {r.req_id: r for r in state.running}
        self.grants: dict[str, int] = {}
        self.admitted: list[str] = []
        self.stalled = False  # a grant was cut for KV safety

    @property
    def slots(self) -> int:
        return self.state.max_running - len(self.views)

    def _after(self) -> tuple[ReqView, ...]:
        return tuple(dataclasses.replace(r, running=True, computed=r.computed + self.grants.get(
            r.req_id, 0)) for r in self.views.values())

    def grant(self, r: ReqView, budget: int) -> int:
        """Give running request ``r`` up to ``budget`` more tokens; returns how many."""
        n = max_advance(r, budget, self.state, self.policy.chunk_align)
        if n <= 0:
            return 0
        while n > 0:
            self.grants[r.req_id] = self.grants.get(r.req_id, 0) + n
            if ref_is_safe(self.state, self._after()):
                return n
            self.grants[r.req_id] -= n
            self.stalled = True
            smaller = max_advance(r, n // 2, self.state, self.policy.chunk_align)
            n = smaller if smaller < n else 0
        if not self.grants.get(r.req_id):
            self.grants.pop(r.req_id, None)
        return 0

    def admit(self, w: ReqView, budget: int) -> int:
        """Admit waiting request ``w`` with a first chunk of up to ``budget`` tokens, if the
        slots, the KV safety rule and the timeline allow; returns the tokens granted (0: not
        admitted)."""
        if self.slots <= 0 or budget <= 0:
            return 0
        n = max_advance(w, budget, self.state, self.policy.chunk_align)
        if n <= 0:
            return 0
        view = dataclasses.replace(w, running=True)
        self.views[w.req_id] = view
        self.grants[w.req_id] = n
        ok = ref_is_safe(self.state, self._after())
        if ok and self.timeline:
            ok = ref_timeline_admits(self.policy, self._trial_state())
        if not ok:
            del self.views[w.req_id]
            del self.grants[w.req_id]
            return 0
        self.admitted.append(w.req_id)
        return n

    def _trial_state(self) -> SchedState:
        return ref_advance(dataclasses.replace(self.state, running=tuple(self.views.values()),
                                           waiting=()), self.decision(), drop_finished=True)

    def decision(self) -> Decision:
        decode = tuple(r.req_id for r in self.state.running if r.decoding)
        order = [rid for rid in self.grants if self.grants[rid] > 0]
        return Decision(prefill=tuple((rid, self.grants[rid]) for rid in order),
                        admit=tuple(self.admitted), decode=decode)

    def finish(self) -> Decision:
        d = self.decision()
        if d.prefill or not any(r.prefilling for r in self.state.running):
            return d
        # Every grant was cut: the head of the safe order can always take its next chunk.
        head = min((r for r in self.state.running if r.prefilling),
                   key=lambda x: need_blocks(self.state, x))
        self.grant(head, head.remaining)
        return self.decision()


def ref_timeline_admits(policy: Any, state: SchedState, horizon: int = 4096) -> bool:
    """Run ``policy`` forward from ``state`` (its waiting queue ignored) until every running
    request is done; False if any step had to cut a grant for KV space."""
    if sum(state.blocks(r.peak_tokens) for r in state.running) <= state.capacity_blocks:
        return True  # everything fits at its peak at once: no schedule can run out
    s = dataclasses.replace(state, waiting=())
    decide_running = getattr(policy, "decide_running", None)
    for _ in range(horizon):
        if not s.running:
            return True
        d, stalled = decide_running(s) if decide_running else (policy.decide(s), False)
        if stalled:
            return False
        s = ref_advance(s, d)
    return False
