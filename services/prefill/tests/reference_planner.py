"""The straightforward planner, as first written (``dataclasses.replace`` per grant, the full
banker's loop on every check, on the rule's own ``reserved_blocks`` / ``need_blocks``): the
reference the fast ``policies.base.Planner`` must match decision for decision
(``test_planner_speedup.py``). Test-only; not imported by the package."""

from __future__ import annotations

import dataclasses
from typing import Any

from agentserving.prefill.policies.base import (
    Planner,
    need_blocks,
    reserved_blocks,
    timeline_admits,
)
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


class RefPlanner(Planner):
    """Builds one step's decision grant by grant, keeping it legal and safe. What the fast
    planner changed (the safety check, the timeline check, ``advance``) is written out again
    here; the planner's state, the grant and admission loops and how a decision is assembled
    from the grants are inherited."""

    def _after(self) -> tuple[ReqView, ...]:
        return tuple(dataclasses.replace(r, running=True, computed=r.computed + self.grants.get(
            r.req_id, 0)) for r in self.views.values())

    def _safe(self) -> bool:
        return ref_is_safe(self.state, self._after())

    def _timeline_ok(self) -> bool:
        return ref_timeline_admits(self.policy, self._trial_state())

    def _trial_state(self) -> SchedState:
        return ref_advance(dataclasses.replace(self.state, running=tuple(self.views.values()),
                                           waiting=()), self.decision(), drop_finished=True)


def ref_timeline_admits(policy: Any, state: SchedState, horizon: int = 4096) -> bool:
    """The timeline check run forward with this module's ``ref_advance``."""
    return timeline_admits(policy, dataclasses.replace(state, waiting=()), horizon,
                           step=ref_advance)
