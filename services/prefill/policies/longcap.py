"""Longcap-FCFS admission with Dynamic Chunk sizing (AgentMem, seed 003 section 2.1).

Each step has a token budget of at most ``step_tokens``. Requests are banded by remaining
prefill length: *short* (at most ``short_tokens`` left) and *long*.

- Longcap-FCFS: while any short request is pending (prefilling or waiting), the long band may
  take at most ``long_cap`` of the step budget; shorts are served first-come-first-served
  from the rest; whatever the shorts leave goes back to the longs (work conserving). At most
  ``max_long_running`` long requests hold KV at once. Within a band, order is FCFS.
- Dynamic Chunk: the long band's chunk is chosen each step from the queue and the free KV:
  ``long_chunk_max`` (default: the whole budget) when no short is pending (few, large,
  efficient steps), ``long_cap`` of the budget when shorts are pending (so they slip in
  between the long turn's chunks), never more than the free KV left after the pending shorts'
  needs, and never below ``min_chunk``. ``long_chunk_max`` also bounds the long band's total
  in a step (top-up included): it bounds how long a step runs, so how long a short turn that
  arrives while a long one is prefilling waits for the next step boundary.

Both keep every decision legal (``--chunk-align``) and KV-safe (see ``base``).
"""

from __future__ import annotations

from agentserving.prefill.policies.base import Planner, free_tokens
from agentserving.prefill.policies.fcfs import _Base
from agentserving.prefill.policies.types import SchedState


class LongcapDynamic(_Base):
    name = "longcap-dynamic"

    def __init__(self, step_tokens: int = 8192, short_tokens: int | None = None,
                 long_cap: float = 0.25, min_chunk: int = 512, max_long_running: int = 1,
                 chunk_align: int = 0, long_chunk_max: int | None = None) -> None:
        if not 0.0 < long_cap <= 1.0:
            raise ValueError("long_cap must be in (0, 1]")
        long_chunk_max = step_tokens if long_chunk_max is None else long_chunk_max
        if not 0 < min_chunk <= long_chunk_max <= step_tokens:
            raise ValueError("need 0 < min_chunk <= long_chunk_max <= step_tokens")
        self.step_tokens = step_tokens
        self.short_tokens = step_tokens if short_tokens is None else short_tokens
        self.long_cap = long_cap
        self.min_chunk = min_chunk
        self.max_long_running = max_long_running
        self.chunk_align = chunk_align
        self.long_chunk_max = long_chunk_max

    def long_chunk(self, state: SchedState, shorts_left: int, shorts_pending: bool) -> int:
        """The long band's budget this step (Dynamic Chunk)."""
        if not shorts_pending:
            return self.long_chunk_max
        chunk = int(self.long_cap * self.step_tokens)
        chunk = min(chunk, free_tokens(state) - shorts_left, self.long_chunk_max)
        return max(self.min_chunk, chunk)

    def _plan(self, state: SchedState, p: Planner) -> None:
        is_short = lambda r: r.remaining <= self.short_tokens  # noqa: E731
        run_pf = sorted((r for r in state.running if r.prefilling), key=lambda x: x.arrival)
        run_long = [r for r in run_pf if not is_short(r)]
        run_short = [r for r in run_pf if is_short(r)]
        wait_short = [w for w in state.waiting if is_short(w)]
        wait_long = [w for w in state.waiting if not is_short(w)]
        shorts_left = sum(r.remaining for r in run_short + wait_short)
        budget = self.step_tokens
        long_budget = min(budget, self.long_chunk(state, shorts_left, bool(shorts_left)))

        # 1. the long band's share (running longs first, then the oldest waiting long)
        long_used = 0
        for r in run_long:
            long_used += p.grant(r, long_budget - long_used)
        n_long = len(run_long)
        for w in wait_long:
            if n_long >= self.max_long_running or long_used >= long_budget:
                break
            n = p.admit(w, long_budget - long_used)
            if n == 0:
                break
            long_used += n
            n_long += 1
        left = budget - long_used

        # 2. shorts, FCFS, from the rest
        for r in run_short:
            left -= p.grant(r, left)
        for w in wait_short:
            if left <= 0:
                break
            n = p.admit(w, left)
            if n == 0:
                break
            left -= n

        # 3. work conserving: what the shorts left goes back to the running longs, up to
        #    the band's ``long_chunk_max`` in all
        band_left = self.long_chunk_max - long_used
        if left > 0 and band_left > 0:
            for r in run_long + [v for v in p.views.values() if v.req_id in p.admitted
                                 and not is_short(v)]:
                extra = min(left, band_left)
                if extra <= 0:
                    break
                got = self._top_up(state, p, r, extra)
                left -= got
                band_left -= got

    @staticmethod
    def _top_up(state: SchedState, p: Planner, r, extra: int) -> int:
        have = p.grants.get(r.req_id, 0)
        if have == 0 and r.req_id not in {v.req_id for v in state.running}:
            return 0
        before = have
        p.grants[r.req_id] = 0
        got = p.grant(r, before + extra)
        if got < before:  # never end up below what it had
            p.grants[r.req_id] = before
            return 0
        return got - before
