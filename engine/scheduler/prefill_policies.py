"""The prefill role's pure policies (services/prefill/policies) behind the reference engine's
``SchedulerPolicy`` protocol: the engine adapts them, the role's folder never imports the
engine.

``EnginePolicy.schedule`` turns the engine's queue into ``ReqView``s (a waiting request's
expected cached prefix comes from ``ctx.lookup_tiers``, which hashes and checks residency
without I/O), asks the pure policy (optionally wrapped in the ``ShadowScheduler``), starts
the shadow's prefetches through ``ctx.prefetch`` (LMCache disk -> DRAM, asynchronous), and
returns the ``StepPlan``. The engine calls ``observe_step(plan, seconds)`` after executing a
plan, which feeds the shadow's step-time model.

Executor rules are passed to the policy as ``quantum = chunk_size`` and ``split_tail``, so
every chunk the policy plans is exactly the chunk the engine runs.

Selected with ``--scheduler-policy NAME[?opt=value&...]``, e.g.
``longcap-dynamic?chunk_align=128&lookahead=5`` (``lookahead`` > 0 wraps the policy in the
ShadowScheduler; ``shadow`` is ``longcap-dynamic`` with ``lookahead=5``, or another policy
with ``base=fcfs-chunk``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentserving.core.schemas import Tier
from agentserving.engine.scheduler.policy import PrefillWork, SchedulerContext, StepPlan
from agentserving.engine.scheduler.request import EngineRequest, RequestState
from agentserving.prefill.policies import FLOAT_OPTIONS, build_policy
from agentserving.prefill.policies.base import PurePolicy
from agentserving.prefill.policies.types import ReqView, SchedState
from agentserving.prefill.shadow import ShadowScheduler, policy_named, split_shadow_options


class EnginePolicy:
    def __init__(self, policy: PurePolicy, *, shadow: ShadowScheduler | None = None,
                 kv_capacity_tokens: int = 1 << 30, block_size: int | None = None) -> None:
        self.pure = policy
        self.shadow = shadow
        self.name = shadow.name if shadow else policy.name
        self.kv_capacity_tokens = kv_capacity_tokens
        self.block_size = block_size
        self.prefetch_log: list[tuple[str, int]] = []  # (req_id, chunks) asked for
        self._last_state: SchedState | None = None
        self._last_decision: Any = None

    # -- views
    @staticmethod
    def _decode_left(r: EngineRequest) -> int:
        if r.wants_remote_decode:
            return 0
        if r.state is RequestState.DECODING:
            return max(0, r.output_budget - len(r.output_token_ids))
        return max(0, r.output_budget - 1)

    def _waiting_view(self, r: EngineRequest, ctx: SchedulerContext) -> ReqView:
        tiers = ctx.lookup_tiers(r)
        usable = min(len(tiers), (r.num_prompt_tokens - 1) // ctx.chunk_size)
        disk = tuple(h for h, t in zip(r.chunk_hashes[:usable], tiers[:usable], strict=False)
                     if t is Tier.DISK)
        return ReqView(r.req_id, r.arrival_time, r.num_prompt_tokens,
                       computed=usable * ctx.chunk_size, decode_left=self._decode_left(r),
                       disk_chunks=disk)

    def state_of(self, waiting: Sequence[EngineRequest], running: Sequence[EngineRequest],
                 ctx: SchedulerContext) -> SchedState:
        run = tuple(ReqView(r.req_id, r.arrival_time, r.num_prompt_tokens,
                            computed=r.num_computed, decode_left=self._decode_left(r),
                            running=True) for r in running)
        wait = tuple(self._waiting_view(r, ctx) for r in waiting)
        return SchedState(wait, run, max_running=ctx.max_running,
                          kv_capacity_tokens=self.kv_capacity_tokens,
                          block_size=self.block_size or ctx.chunk_size,
                          quantum=ctx.chunk_size, split_tail=True, now=ctx.now)

    # -- SchedulerPolicy
    def schedule(self, waiting: Sequence[EngineRequest], running: Sequence[EngineRequest],
                 ctx: SchedulerContext) -> StepPlan:
        state = self.state_of(waiting, running, ctx)
        if self.shadow is not None:
            res = self.shadow.step(state)
            decision = res.decision
            for rid, hashes in res.prefetch:
                ctx.prefetch(list(hashes))
                self.prefetch_log.append((rid, len(hashes)))
        else:
            decision = self.pure.decide(state)
        self._last_state, self._last_decision = state, decision
        by_id = {r.req_id: r for r in (*waiting, *running)}
        plan = StepPlan(prefill=[PrefillWork(by_id[rid], n) for rid, n in decision.prefill],
                        decode=[by_id[rid] for rid in decision.decode])
        return plan

    def observe_step(self, plan: StepPlan, seconds: float) -> None:
        """The engine's measured time for the last plan (feeds the step-time model)."""
        if self.shadow is None or self._last_decision is None or self._last_state is None:
            return
        self.shadow.observe_step(self._last_decision, self._last_state, seconds)


ENGINE_POLICIES = ("fcfs-nochunk", "fcfs-chunk", "longcap-dynamic", "shadow")
_INT_OPTS = {"step_tokens", "short_tokens", "min_chunk", "max_long_running", "chunk_align",
             "long_chunk_max", "short_step", "shorts_per_step", "kv_capacity_tokens",
             "block_size", "chunk_tokens"}


def make_engine_policy(name: str, chunk_tokens: int, **options: Any) -> EnginePolicy:
    """Factory behind the engine's ``POLICIES`` entries. ``chunk_tokens`` is the worker's
    ``--prefill-chunk-tokens``: the fixed chunk of ``fcfs-chunk``; the others default their
    step budget to 4x it."""
    opts = {k: (int(v) if k in _INT_OPTS else float(v) if k in FLOAT_OPTIONS else v)
            for k, v in options.items()}
    shadow_kw, opts = split_shadow_options(opts, 5 if name == "shadow" else 0)
    engine_kw = {k: opts.pop(k) for k in ("kv_capacity_tokens", "block_size") if k in opts}
    base = policy_named(name, opts)
    if base == "fcfs-chunk":
        opts.setdefault("chunk_tokens", chunk_tokens)
    else:
        opts.setdefault("step_tokens", 4 * chunk_tokens)
    if base == "longcap-dynamic":
        opts.setdefault("min_chunk", chunk_tokens)
    policy = build_policy(base, **opts)
    shadow = ShadowScheduler(policy, **shadow_kw) if shadow_kw else None
    return EnginePolicy(policy, shadow=shadow, **engine_kw)
