"""What every policy shares: legal chunk sizes, the KV safety rule, and the planner.

KV safety (the no-eviction guarantee). A request *reserves* ``blocks(computed)`` while it
prefills and ``blocks(prompt + decode_left)`` once it decodes; it *needs* the rest of its
peak. A state is safe when the running requests can be finished one after another, each
taking its need from the free blocks and then releasing everything it holds (the banker's
algorithm for one resource: finishing them in order of increasing need is optimal). Every
decision a policy returns leaves the pod in a safe state, whatever the arrivals and whatever
the later decisions: a grant that would make the state unsafe is shrunk or dropped, and a safe
state always allows at least one request to progress. So no request ever has to be evicted or
recomputed for lack of KV space; at worst it stalls for a step.

Admission is timeline-aware on top of that (``timeline_admits``): a request is admitted only
if the policy's own forward simulation of the running set plus the candidate (no further
arrivals) finishes every request without a single KV stall, i.e. "admit now, evict (or stall)
later" never happens by the policy's own prediction.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

from agentserving.prefill.policies.executor import pass_limit
from agentserving.prefill.policies.types import Decision, ReqView, SchedState, advance, evolve


class PurePolicy(Protocol):
    name: str
    chunk_align: int

    def decide(self, state: SchedState) -> Decision: ...


def unit(state: SchedState, align: int) -> int:
    """Non-final chunks end on multiples of this (the executor's quantum and the alignment)."""
    q = max(1, state.quantum)
    return q * max(1, align) // math.gcd(q, max(1, align))


def max_advance(r: ReqView, budget: int, state: SchedState, align: int) -> int:
    """The most new tokens ``r`` may prefill this step within ``budget`` (0: none legal).

    A chunk that completes the prompt (or, with ``split_tail``, the prompt's full chunks) may
    end anywhere; any other chunk ends where ``computed + new`` is a multiple of ``unit``
    (the ``--chunk-align`` rule: cached + new tokens stay a multiple of 128)."""
    start, total = r.computed, r.prompt_len
    if budget <= 0 or start >= total:
        return 0
    limit = pass_limit(start, total, state.quantum, state.split_tail)
    if start + budget >= limit:
        return limit - start
    u = unit(state, align)
    end = (start + budget) // u * u
    return max(0, end - start)


def reserved_blocks(state: SchedState, r: ReqView) -> int:
    if r.running and r.remaining == 0:
        return state.blocks(r.peak_tokens)
    return state.blocks(r.computed) if r.running else 0


def need_blocks(state: SchedState, r: ReqView) -> int:
    return state.blocks(r.peak_tokens) - reserved_blocks(state, r)


def is_safe(state: SchedState, running: tuple[ReqView, ...] | None = None) -> bool:
    running = state.running if running is None else running
    bs = state.block_size
    return _banker_safe(state.capacity_blocks, [
        (-(-r.peak_tokens // bs), r.running, r.computed, r.prompt_len) for r in running], bs)


def _banker_safe(capacity: int, rows: list[tuple[int, bool, int, int]], bs: int) -> bool:
    """The banker's check on ``(peak blocks, running, computed, prompt_len)`` rows (integer
    ceilings instead of ``reserved_blocks`` / ``need_blocks`` per call: same numbers)."""
    if sum(row[0] for row in rows) <= capacity:
        return True  # everything fits at its peak at once: every order finishes
    free = capacity
    pairs = []
    for peak, running, computed, prompt_len in rows:
        if not running:
            res = 0
        elif computed >= prompt_len:
            res = peak
        else:
            res = -(-computed // bs)
        free -= res
        pairs.append((peak - res, res))
    if free < 0:
        return False
    # increasing need (ties in any order: a need that fits leaves more for its equals)
    pairs.sort()
    for need, res in pairs:
        if need > free:
            return False
        free += res
    return True


def free_tokens(state: SchedState) -> int:
    used = sum(reserved_blocks(state, r) for r in state.running)
    return (state.capacity_blocks - used) * state.block_size


class Planner:
    """Builds one step's decision grant by grant, keeping it legal and safe.

    Speed (the cluster simulator calls this for every pod and step, and the timeline check
    runs whole planners forward): the safety check works on integer rows kept per request
    (peak blocks, computed) rather than rebuilding ``ReqView``s per grant, and skips the
    banker's loop while the requests' peaks fit the pod together. Decisions are the same as
    the straightforward version (``tests/reference_planner.py``; compared on random queues).
    """

    def __init__(self, state: SchedState, policy: PurePolicy, *, timeline: bool = True) -> None:
        self.state = state
        self.policy = policy
        self.timeline = timeline
        self.views = {r.req_id: r for r in state.running}
        self.grants: dict[str, int] = {}
        self.admitted: list[str] = []
        self.stalled = False  # a grant was cut for KV safety
        bs = state.block_size
        self._bs = bs
        self._cap = state.capacity_blocks
        self._peak = {r.req_id: -(-r.peak_tokens // bs) for r in state.running}
        self._peak_sum = sum(self._peak.values())

    @property
    def slots(self) -> int:
        return self.state.max_running - len(self.views)

    def _after(self) -> tuple[ReqView, ...]:
        return tuple(evolve(r, running=True, computed=r.computed + self.grants.get(
            r.req_id, 0)) for r in self.views.values())

    def _safe(self) -> bool:
        """``is_safe(state, self._after())``, from the kept rows."""
        if self._peak_sum <= self._cap:
            return True
        g = self.grants
        peak = self._peak
        return _banker_safe(self._cap, [
            (peak[rid], True, r.computed + g.get(rid, 0), r.prompt_len)
            for rid, r in self.views.items()], self._bs)

    def grant(self, r: ReqView, budget: int) -> int:
        """Give running request ``r`` up to ``budget`` more tokens; returns how many."""
        n = max_advance(r, budget, self.state, self.policy.chunk_align)
        if n <= 0:
            return 0
        while n > 0:
            self.grants[r.req_id] = self.grants.get(r.req_id, 0) + n
            if self._safe():
                return n
            self.grants[r.req_id] -= n
            self.stalled = True
            smaller = max_advance(r, n // 2, self.state, self.policy.chunk_align)
            n = smaller if smaller < n else 0
        if not self.grants.get(r.req_id):
            self.grants.pop(r.req_id, None)
        return 0

    def first_chunk(self, w: ReqView, budget: int) -> int:
        """The first chunk waiting request ``w`` could get within ``budget`` if a slot is
        free, before any KV check (0: none)."""
        if self.slots <= 0 or budget <= 0:
            return 0
        return max(0, max_advance(w, budget, self.state, self.policy.chunk_align))

    def admit(self, w: ReqView, budget: int) -> int:
        """Admit waiting request ``w`` with a first chunk of up to ``budget`` tokens, if the
        slots, the KV safety rule and the timeline allow; returns the tokens granted (0: not
        admitted)."""
        n = self.first_chunk(w, budget)
        if n <= 0:
            return 0
        rid = w.req_id
        self.views[rid] = evolve(w, running=True)
        self.grants[rid] = n
        peak = -(-w.peak_tokens // self._bs)
        self._peak[rid] = peak
        self._peak_sum += peak
        ok = self._safe() and (not self.timeline or self._timeline_ok())
        if not ok:
            del self.views[rid]
            del self.grants[rid]
            del self._peak[rid]
            self._peak_sum -= peak
            return 0
        self.admitted.append(rid)
        return n

    def _timeline_ok(self) -> bool:
        # (peaks that fit together also pass the timeline: skip building its trial state)
        return self._peak_sum <= self._cap or timeline_admits(self.policy, self._trial_state())

    def _trial_state(self) -> SchedState:
        return advance(evolve(self.state, running=tuple(self.views.values()), waiting=()),
                       self.decision(), drop_finished=True)

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


def timeline_admits(policy: PurePolicy, state: SchedState, horizon: int = 4096,
                    step: Callable[[SchedState, Decision], SchedState] | None = None) -> bool:
    """Run ``policy`` forward from ``state`` (its waiting queue ignored) until every running
    request is done; False if any step had to cut a grant for KV space. ``step`` moves the
    state on by a decision (``advance``; the tests' reference planner passes its own)."""
    step = step or advance
    if sum(state.blocks(r.peak_tokens) for r in state.running) <= state.capacity_blocks:
        return True  # everything fits at its peak at once: no schedule can run out
    s = evolve(state, waiting=())
    decide_running = getattr(policy, "decide_running", None)
    for _ in range(horizon):
        if not s.running:
            return True
        d, stalled = decide_running(s) if decide_running else (policy.decide(s), False)
        if stalled:
            return False
        s = step(s, d)
    return False
