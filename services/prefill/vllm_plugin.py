"""vLLM-facing glue for the pure prefill policies: a ``--scheduler-cls`` plugin.

    vllm serve MODEL --scheduling-policy fcfs \\
        --scheduler-cls agentserving.prefill.vllm_plugin.LongcapScheduler
    # or PolicyScheduler with AGENTSERVING_PREFILL_POLICY='fcfs-chunk?chunk_tokens=2048'

The decisions are the same policy objects the reference engine and the simulator use
(``policies.build_policy``); this module only translates. The vLLM-facing surface is two
methods of vLLM's v1 ``Scheduler`` (``vllm.v1.core.sched.scheduler``, checked against 0.33.0):

1. ``schedule()``: before vLLM's own pass, build ``ReqView``s from ``self.waiting`` /
   ``self.running`` (``views_from_vllm``), ask the policy for a ``Decision``, move the
   admitted waiting requests to the head of the FCFS queue in the policy's order
   (``order_waiting``), keep the per-request token budgets (``budgets``), then call vLLM's
   ``schedule()`` unchanged.
2. ``_mamba_block_aligned_split(request, n, ...)``: vLLM's per-request "clip this chunk" hook,
   called for every running and every newly scheduled request after vLLM has sized its chunk
   (and only when ``need_mamba_block_aligned_split`` is set, which the subclass sets). The
   override applies vLLM's own Mamba split when the model needs it, then clips ``n`` to the
   policy's grant (``clip``). 0 means "not this step": vLLM skips a running request and stops
   admitting (the rest of the queue waits), which is the policy's strict admission order.

So vLLM still owns blocks, preemption, prefix-cache lookups and the output; the policy owns
which requests run and how many tokens each gets. Requires the FCFS request queue (a
priority queue cannot be reordered). Known gaps: a waiting request's cached prefix is not
known to vLLM before it is scheduled (``num_cached_tokens`` is -1 until then), so the policy
looks a waiting request's cached prefix up itself (vLLM's ``find_longest_cache_hit``; LMCache's
external hits are not seen before scheduling); vLLM may still schedule fewer tokens than granted
(its own budgets, encoder inputs, block allocation failure), never more.

What was exercised here (``tests/test_vllm_plugin.py``). vLLM cannot *run* on these machines
(its C extension needs libcuda), but its v1 scheduler is plain Python: with vLLM 0.33.0 from
the test-only env of ``scripts/vllm-test-env.sh`` (a child process, ``vllm_sched_probe.py``)
the subclass is built on vLLM's real ``Scheduler`` with a real ``VllmConfig`` (tiny Llama
config, CPU device), fed real ``Request``s and stepped with ``schedule()`` /
``update_from_output()`` (fake model outputs: one sampled token when a prompt completes);
at every step the tokens vLLM scheduled equal the policy's decision on the same queue, and
every request completes. Also against a thin stand-in with vLLM's loop shape (no vLLM
needed). NOT exercised: a forward pass, a KV connector, preemption under KV pressure, spec
decoding, async scheduling (``AsyncScheduler``), the priority queue.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from agentserving.prefill.policies import POLICY_CLASSES, build_policy
from agentserving.prefill.policies.base import PurePolicy
from agentserving.prefill.policies.types import Decision, ReqView, SchedState

POLICY_ENV = "AGENTSERVING_PREFILL_POLICY"


# ------------------------------------------------------------------ pure translation

def views_from_vllm(waiting: Iterable[Any], running: Iterable[Any],
                    cached: Callable[[Any], int] | None = None) -> tuple[
        tuple[ReqView, ...], tuple[ReqView, ...]]:
    """vLLM ``Request``s (``request_id``, ``arrival_time``, ``num_prompt_tokens``,
    ``num_computed_tokens``, ``num_cached_tokens``) -> ``ReqView``s. Decode progress is not
    planned by the policy (``decode_left`` 0: a prefill pod). A waiting request's cached
    prefix is ``cached(request)`` (the scheduler's prefix-cache lookup): vLLM itself only knows
    it once the request is scheduled, and without it a short append to a long cached context
    looks like a long prompt."""
    def view(r: Any, is_running: bool) -> ReqView:
        if is_running:
            computed = r.num_computed_tokens
        else:
            known = getattr(r, "num_cached_tokens", 0) or 0
            computed = max(0, known, cached(r) if cached is not None else 0)
        return ReqView(r.request_id, float(r.arrival_time), int(r.num_prompt_tokens),
                       computed=int(min(computed, r.num_prompt_tokens)), running=is_running)

    return (tuple(view(r, False) for r in waiting), tuple(view(r, True) for r in running))


def budgets(decision: Decision) -> dict[str, int]:
    """request_id -> prompt tokens to schedule this step (vLLM's ``num_scheduled_tokens``)."""
    out = dict(decision.prefill)
    for rid in decision.decode:
        out[rid] = out.get(rid, 0) + 1
    return out


def order_waiting(waiting: list[Any], decision: Decision) -> list[Any]:
    """The waiting queue with the admitted requests first, in the policy's order; the rest
    keep their order behind them."""
    rank = {rid: i for i, rid in enumerate(decision.admit)}
    head = sorted((r for r in waiting if r.request_id in rank),
                  key=lambda r: rank[r.request_id])
    return head + [r for r in waiting if r.request_id not in rank]


def clip(grants: dict[str, int] | None, request: Any, num_new_tokens: int) -> int:
    """vLLM's chunk for ``request`` clipped to the policy's grant (no grant: 0; outside a
    policy-driven step: unchanged). A request still decoding keeps vLLM's tokens."""
    if grants is None:
        return num_new_tokens
    if request.num_computed_tokens >= request.num_prompt_tokens:
        return num_new_tokens  # decoding: the policy only plans prefill
    return min(num_new_tokens, grants.get(request.request_id, 0))


class PolicyGlue:
    """The state a scheduler subclass keeps: the policy and the pod's KV shape."""

    def __init__(self, policy: PurePolicy, *, kv_capacity_tokens: int, block_size: int,
                 max_running: int) -> None:
        self.policy = policy
        self.kv_capacity_tokens = kv_capacity_tokens
        self.block_size = block_size
        self.max_running = max_running

    def decide(self, waiting: Iterable[Any], running: Iterable[Any],
               cached: Callable[[Any], int] | None = None) -> Decision:
        wait, run = views_from_vllm(waiting, running, cached)
        state = SchedState(wait, run, max_running=self.max_running,
                           kv_capacity_tokens=self.kv_capacity_tokens,
                           block_size=self.block_size, now=time.monotonic())
        return self.policy.decide(state)


def policy_from_env(default: str, step_tokens: int | None = None) -> PurePolicy:
    """``NAME[?opt=value&...]`` from ``AGENTSERVING_PREFILL_POLICY`` (vLLM passes no options to
    a scheduler class), integer options parsed as ints. ``step_tokens`` (vLLM's token budget
    per step) is the policy's own unless the spec sets it: a policy planning bigger steps than
    vLLM runs would size its chunks for a budget that is not there."""
    import inspect
    import urllib.parse

    spec = os.environ.get(POLICY_ENV, default)
    name, _, query = spec.partition("?")
    opts: dict[str, Any] = {}
    cls = POLICY_CLASSES.get(name)
    if step_tokens and cls is not None and "step_tokens" in inspect.signature(cls).parameters:
        opts["step_tokens"] = step_tokens
    for k, v in urllib.parse.parse_qsl(query):
        opts[k] = (int(v) if v.lstrip("-").isdigit() else
                   float(v) if k in ("long_cap", "context_cost", "split_overhead",
                                     "attention_cost", "step_cost") else v)
    return build_policy(name, **opts)


# ------------------------------------------------------------------ the vLLM subclass

def make_scheduler_cls(base: type, default_policy: str = "longcap-dynamic") -> type:
    """A subclass of ``base`` (vLLM's ``Scheduler``, or a stand-in with its shape) whose
    ``schedule()`` follows the policy."""

    class PolicyScheduler(base):  # type: ignore[misc, valid-type]
        policy_spec = default_policy

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._vllm_split = bool(getattr(self, "need_mamba_block_aligned_split", False))
            self.need_mamba_block_aligned_split = True  # route every chunk through clip()
            self._grants: dict[str, int] | None = None
            block_size = int(getattr(self, "block_size", 16))
            blocks = int(getattr(getattr(self, "cache_config", None), "num_gpu_blocks", 0)
                         or 0)
            budget = getattr(self, "max_num_scheduled_tokens", None)
            self.glue = PolicyGlue(policy_from_env(self.policy_spec, budget),
                                   kv_capacity_tokens=blocks * block_size or 1 << 40,
                                   block_size=block_size,
                                   max_running=int(getattr(self, "max_num_running_reqs", 64)))

        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            waiting = list(self.waiting)
            decision = self.glue.decide(waiting, self.running, self._cached_tokens)
            self.waiting.clear()
            self.waiting.extend(order_waiting(waiting, decision))
            self._grants = budgets(decision)
            try:
                return super().schedule(*args, **kwargs)
            finally:
                self._grants = None

        def _cached_tokens(self, request: Any) -> int:
            """Tokens of ``request`` already in this pod's prefix cache: vLLM's own lookup
            (``find_longest_cache_hit``, which counts no stats and takes no blocks); 0 when
            the scheduler has none (a stand-in, prefix caching off)."""
            coordinator = getattr(getattr(self, "kv_cache_manager", None), "coordinator",
                                  None)
            hashes = getattr(request, "block_hashes", None)
            if coordinator is None or not hashes:
                return 0
            try:
                hit = coordinator.find_longest_cache_hit(hashes, request.num_tokens - 1)
            except (AttributeError, TypeError, ValueError):
                return 0
            return int(hit[1])

        def _mamba_block_aligned_split(self, request: Any, num_new_tokens: int,
                                       *args: Any) -> int:
            if self._vllm_split:
                num_new_tokens = super()._mamba_block_aligned_split(request, num_new_tokens,
                                                                    *args)
            return clip(self._grants, request, num_new_tokens)

    PolicyScheduler.__qualname__ = PolicyScheduler.__name__ = f"Policy{base.__name__}"
    return PolicyScheduler


def _vllm_scheduler_base() -> type:
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
    except ImportError as exc:  # vLLM is not a dependency of this project
        err = exc

        class VllmMissing:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                raise ImportError(f"agentserving.prefill.vllm_plugin needs vLLM: {err}")

            def _mamba_block_aligned_split(self, request: Any, n: int, *args: Any) -> int:
                return n

        return VllmMissing
    return Scheduler


def __getattr__(name: str) -> type:
    """``PolicyScheduler`` (policy from ``AGENTSERVING_PREFILL_POLICY``, default
    longcap-dynamic) and ``LongcapScheduler`` (longcap-dynamic unless the variable says
    otherwise) are built on first access, so importing this module never imports vLLM."""
    if name in ("PolicyScheduler", "LongcapScheduler"):
        cls = make_scheduler_cls(_vllm_scheduler_base())
        cls.__name__ = cls.__qualname__ = name
        globals()[name] = cls
        return cls
    raise AttributeError(name)
