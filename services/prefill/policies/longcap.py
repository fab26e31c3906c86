"""Longcap-FCFS admission with Dynamic Chunk sizing (AgentMem, seed 003 section 2.1).

Requests are banded by remaining prefill length: *short* (at most ``short_tokens`` left) and
*long*.

- Longcap: while any short request is pending (prefilling or waiting), the long band may take
  at most ``long_cap`` of the step budget (never less than ``min_chunk``: it is never
  starved); shorts are served from the rest; whatever the shorts leave goes back to the
  running longs (work conserving). At most ``max_long_running`` long requests hold KV at
  once. Longs are served FCFS.
- Short order (``short_order``): ``"fcfs"`` (the default, as first built: started shorts,
  then arrival order) or ``"shortest"``: shortest remaining first (FCFS among equals). Why
  ``shortest`` (what the bench's tuned configuration uses): under load the short
  band itself queues (most agent turns are short, and they arrive faster than one step drains
  them); FCFS inside it makes a 200-token turn wait behind 3,000-token ones, which is where the
  P85 latency went. Shortest-first is the classic mean/percentile-latency optimum; the long
  band's cap and the band split keep the longest turns from starving. ``"cost"``: cheapest
  remaining *work* first (``cost``: the step-time model's ratios ``context_cost`` = c/b and
  ``attention_cost`` = d/b). Why: when re-reading the context costs (c > 0), a turn's seconds
  follow its context more than its new tokens (900 new tokens over 25k of context take ~8x
  the seconds of 900 over none), so ranking by tokens queues cheap turns behind dear ones.
- One short per step (``shorts_per_step=1``): every turn in a step finishes when the step
  does, so a second short in the step delays the first by its whole chunk and saves only the
  per-step overhead ``a`` (0 in this session's fits): serving the head alone is serial
  shortest-work-first. The default (0) fills the step as first built.
- ``step_cost`` (new-token units, 0: off): the head short's chunk is as large as fits that
  predicted cost (``tokens_within``), never below ``short_step`` or its ``min_split``: a
  shallow turn runs in a few large chunks, a deep one in small ones.
- Longest wait (``long_max_wait_s``, seconds; 0: off): a long request that has waited that
  long since its arrival is served as if no short were pending: its band takes the whole step
  (up to ``long_chunk_max``), and it is admitted past ``max_long_running``. Why: under a
  steady stream of shorts the long band's cap makes every long turn's prefill run at
  ``long_cap`` of the pod for as long as shorts keep coming, and the longs queue behind each
  other (one at a time); on a pod that takes short and long turns alike (a decode pod
  prefilling the appends of the sessions it hosts) those longs became the slowest turns of the
  run. The bound gives shorts their priority for that long, then lets FCFS finish the long.
- Dynamic Chunk: the step budget and the long band's chunk follow the queue and the free KV.
  While shorts are pending a step carries at most ``short_step`` tokens (default:
  ``step_tokens``): every turn in a step finishes only when the step does, so a small step
  while short turns wait is what makes them fast; with no short pending the long band takes
  ``long_chunk_max`` (few, large, efficient steps). The long band's chunk is ``long_cap`` of
  the step when shorts are pending, never more than the free KV left after the pending shorts'
  needs, and never below ``min_chunk``. ``long_chunk_max`` also bounds the long band's total
  in a step (top-up included): it bounds how long a step runs, so how long a short turn that
  arrives while a long one is prefilling waits for the next step boundary.

Both keep every decision legal (``--chunk-align``) and KV-safe (see ``base``).
"""

from __future__ import annotations

from agentserving.prefill.policies.base import Planner, free_tokens, max_advance
from agentserving.prefill.policies.executor import pass_limit
from agentserving.prefill.policies.fcfs import _Base
from agentserving.prefill.policies.types import SchedState

SHORT_ORDERS = ("fcfs", "shortest", "cost")


class LongcapDynamic(_Base):
    name = "longcap-dynamic"

    def __init__(self, step_tokens: int = 8192, short_tokens: int | None = None,
                 long_cap: float = 0.25, min_chunk: int = 512, max_long_running: int = 1,
                 chunk_align: int = 0, long_chunk_max: int | None = None,
                 short_step: int | None = None, short_order: str = "fcfs",
                 context_cost: float = 0.0, split_overhead: float = 0.25,
                 attention_cost: float = 0.0, shorts_per_step: int = 0,
                 step_cost: float = 0.0, long_max_wait_s: float = 0.0) -> None:
        if not 0.0 < long_cap <= 1.0:
            raise ValueError("long_cap must be in (0, 1]")
        long_chunk_max = step_tokens if long_chunk_max is None else long_chunk_max
        if not 0 < min_chunk <= long_chunk_max <= step_tokens:
            raise ValueError("need 0 < min_chunk <= long_chunk_max <= step_tokens")
        short_step = step_tokens if short_step is None else short_step
        if not 0 < short_step <= step_tokens:
            raise ValueError("need 0 < short_step <= step_tokens")
        if min(min_chunk, short_step) < chunk_align:  # no aligned chunk would fit: a stall
            raise ValueError("min_chunk and short_step must be >= chunk_align")
        if short_order not in SHORT_ORDERS:
            raise ValueError(f"short_order must be one of {SHORT_ORDERS}")
        if min(context_cost, attention_cost, step_cost, shorts_per_step, long_max_wait_s) < 0:
            raise ValueError("context_cost, attention_cost, step_cost, shorts_per_step and "
                             "long_max_wait_s must be >= 0")
        self.step_tokens = step_tokens
        self.short_tokens = step_tokens if short_tokens is None else short_tokens
        self.long_cap = long_cap
        self.min_chunk = min_chunk
        self.max_long_running = max_long_running
        self.chunk_align = chunk_align
        self.long_chunk_max = long_chunk_max
        self.short_step = short_step
        self.short_order = short_order
        self.context_cost = context_cost
        self.split_overhead = split_overhead
        self.attention_cost = attention_cost
        self.shorts_per_step = shorts_per_step
        self.step_cost = step_cost
        self.long_max_wait_s = long_max_wait_s

    def overdue(self, r, state: SchedState) -> bool:  # noqa: ANN001
        """``r`` has waited ``long_max_wait_s`` since its arrival (never, when that is 0)."""
        return bool(self.long_max_wait_s) and state.now - r.arrival >= self.long_max_wait_s

    def long_chunk(self, state: SchedState, shorts_left: int, shorts_pending: bool,
                   budget: int | None = None) -> int:
        """The long band's budget this step (Dynamic Chunk); ``budget``: the step's."""
        if not shorts_pending:
            return self.long_chunk_max
        budget = self.step_tokens if budget is None else budget
        chunk = int(self.long_cap * budget)
        chunk = min(chunk, free_tokens(state) - shorts_left, self.long_chunk_max)
        return max(self.min_chunk, chunk)

    def min_split(self, r) -> int:  # noqa: ANN001
        """The smallest non-final chunk worth cutting for ``r``: every extra chunk re-reads the
        request's context, ``context_cost * computed`` new-token-equivalents (``c / b`` of the
        step-time model ``a + b*new + c*context + ...``); a chunk is cut only if that stays
        within ``split_overhead`` of its own cost: its size times a new token's cost there,
        ``1 + attention_cost * computed`` (deep in a context a token is dearer, so a smaller
        chunk is already worth cutting). 0 when context reads are free."""
        per_token = 1.0 + self.attention_cost * r.computed  # a new token's cost there
        return int(self.context_cost * r.computed / (self.split_overhead * per_token))

    def cost(self, r, state: SchedState) -> float:  # noqa: ANN001
        """``r``'s remaining work in new-token equivalents, by the step-time model's ratios:
        its remaining tokens, one context re-read (``context_cost * computed``) per chunk
        still to run (two when the executor splits the trailing partial chunk off), and the
        attention pairs (``attention_cost``, d / b). The ``cost`` short order sorts by it."""
        start, total = r.computed, r.prompt_len
        n = total - start
        chunks = 1 + (pass_limit(start, total, state.quantum, state.split_tail) < total)
        return (n + self.context_cost * start * chunks
                + self.attention_cost * n * (start + (n + 1) / 2))

    def step_budget(self, shorts: list) -> int:
        """The step's token budget (Dynamic Chunk): ``step_tokens`` with no short pending,
        else ``short_step``, grown (up to ``step_tokens``) so that the first short in order
        is not cut into a chunk below its ``min_split``."""
        if not shorts:
            return self.step_tokens
        head = shorts[0]
        step = self.short_step
        if self.step_cost:
            step = max(step, self.tokens_within(head, self.step_cost))
        return min(self.step_tokens, max(step, min(head.remaining, self.min_split(head))))

    def tokens_within(self, r, cost: float) -> int:  # noqa: ANN001
        """The most new tokens one chunk of ``r`` carries for at most ``cost`` new-token
        equivalents, its context re-read and attention pairs included (0 if the re-read
        alone exceeds it): the positive root of ``n + ac*n*(s + (n+1)/2) = cost - cc*s``."""
        s, cc, ac = r.computed, self.context_cost, self.attention_cost
        left = cost - cc * s
        if left <= 0:
            return 0
        k = 1.0 + ac * (s + 0.5)
        if ac <= 0:
            return int(left / k)
        return int((-k + (k * k + 2.0 * ac * left) ** 0.5) / ac)

    def _plan(self, state: SchedState, p: Planner) -> None:
        short_tokens = self.short_tokens
        run_long, shorts = [], []
        for r in state.running:
            if r.prefilling:
                (shorts if r.remaining <= short_tokens else run_long).append(r)
        run_long.sort(key=lambda x: x.arrival)
        wait_long = []
        for w in state.waiting:
            (shorts if w.remaining <= short_tokens else wait_long).append(w)
        wait_long.sort(key=lambda x: x.arrival)  # (a caller's queue may be in any order)
        if self.short_order == "cost":
            # cheapest remaining work first (SRPT on the model's cost, not on token counts)
            shorts.sort(key=lambda x: (self.cost(x, state), not x.running, x.arrival))
        elif self.short_order == "shortest":
            # running before waiting among equals: a started short is never overtaken by a twin
            shorts.sort(key=lambda x: (x.remaining, not x.running, x.arrival))
        else:
            shorts.sort(key=lambda x: (not x.running, x.arrival))  # started ones, then FCFS
        shorts_left = sum(r.remaining for r in shorts)
        budget = self.step_budget(shorts)
        # an overdue long (the oldest running one, else the oldest waiting) lifts the cap
        overdue = any(self.overdue(r, state) for r in run_long[:1] or wait_long[:1])
        long_budget = min(budget, self.long_chunk(state, shorts_left, bool(shorts) and not
                                                  overdue, budget))

        # 1. the long band's share (running longs first, then the oldest waiting long)
        long_used = 0
        for r in run_long:
            # (a long chunk below its ``min_split`` is not cut: it grows, up to the band max)
            want = max(long_budget, min(self.min_split(r), self.long_chunk_max))
            long_used += p.grant(r, want - long_used)
        n_long = len(run_long)
        for w in wait_long:
            if (n_long >= self.max_long_running and not self.overdue(w, state)) \
                    or long_used >= long_budget:
                break
            n = p.admit(w, long_budget - long_used)
            if n == 0:
                break
            long_used += n
            n_long += 1
        left = max(0, budget - long_used)

        # 2. shorts from the rest; a short that cannot start (slots, KV) stops admissions
        #    (no overtaking it) but the running shorts behind it still progress
        #    (a short's partial chunk below its ``min_split`` is not cut: it waits whole)
        #    (the first short is exempt: the budget was sized for it)
        admitting = True
        served = 0
        for i, r in enumerate(shorts):
            if left <= 0 or (self.shorts_per_step and served >= self.shorts_per_step):
                break
            if i and self.context_cost:
                n = max_advance(r, left, state, self.chunk_align)
                if n < self.min_split(r) and n < max_advance(r, r.remaining, state,
                                                             self.chunk_align):
                    admitting = admitting and r.running
                    continue
            if r.running:
                n = p.grant(r, left)
            elif admitting:
                n = p.admit(r, left)
                admitting = n > 0
            else:
                n = 0
            left -= n
            served += n > 0

        # 3. work conserving: what the shorts left goes back to the running longs, up to
        #    the band's ``long_chunk_max`` in all
        band_left = self.long_chunk_max - long_used
        if left > 0 and band_left > 0:
            admitted = set(p.admitted)
            for r in run_long + [v for v in p.views.values() if v.req_id in admitted
                                 and v.remaining > short_tokens]:
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
