"""The simulated cluster: a proxy, a kvindex and pods, on one event loop.

What runs for real (the objects the services run, called with the same inputs):
- the proxy's routing policy (``agentserving.proxy.routing.make_policy``: ``RouteInput`` of
  ``Candidate`` pods with their in-flight turns and the kvindex ``PodPrefix`` per pod, built the
  way ``agentserving.proxy.orchestrator`` builds it: lookup of the session's previous chunk
  hashes, role prefill) and ``LeastLoaded`` for decode pods;
- the kvindex (``InMemoryIndex``: pods register, tiers report ``EventBatch``es, lookups rank
  with ``rank_prefixes``);
- the proxy's memory of each session (``proxy.sessions.SessionState``: the previous turn's
  chunk hashes, its pods and prompt size, written after the turn, read before the next; a
  branch's first turn starts from its parent's, by ``fork_from``) and its conditional
  disaggregation planner (``proxy.disagg.plan_local_pod``);
- the prefill policy (``agentserving.prefill.policies.build_policy``), wrapped in the
  ``ShadowScheduler`` whose N+1 prefetch moves disk chunks to DRAM; or, with
  ``engine_scheduler``, the reference engine's own scheduler (``engine.scheduler.policy``)
  under the engine's executor rules, as `agentserving compare` runs every worker.

What is modelled: step times (``Profile``), the KV tiers (``PodTiers``) on prefill and decode
pods, KV transfers, decode as steps of the whole running batch (mixed with a prefill chunk on
``both`` pods), and, for a profile with ``host_cores``, pods sharing one host's cores
(``Host``). See docs/sim.md.
"""

from __future__ import annotations

import dataclasses
import gc
import re
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agentserving.core.hashing import DEFAULT_CHUNK_SIZE
from agentserving.core.schemas import PodRegistration, PodRole, Tier
from agentserving.engine.scheduler.policy import (
    DECODE_POD_CHUNK_TOKENS,
    DECODE_POD_POLICY,
    SchedulerContext,
)
from agentserving.engine.scheduler.registry import make_policy as make_engine_policy
from agentserving.engine.scheduler.request import RequestState
from agentserving.kvindex.index.base import rank_prefixes
from agentserving.kvindex.index.memory import InMemoryIndex
from agentserving.prefill.policies import ReqView, SchedState, build_policy
from agentserving.prefill.policies.executor import pass_end
from agentserving.prefill.shadow import ShadowScheduler, StepTimeModel
from agentserving.proxy.disagg import Placement, PromptSize, plan_local_pod
from agentserving.proxy.routing import Candidate, LeastLoaded, RouteInput, make_policy
from agentserving.proxy.sessions import SessionState
from agentserving.replay.metrics import summarize
from agentserving.sim.events import EventLoop, run_sync
from agentserving.sim.host import Host
from agentserving.sim.profile import Profile
from agentserving.sim.tiers import DiskReads, PodTiers
from agentserving.sim.workload import SimSession, SimTurn, with_poisson_starts

CONFIGS = ("baseline", "agentserving")


@dataclass
class SimConfig:
    config: str = "agentserving"          # agentserving | baseline
    topology: str = "1P3D"                # xPyD, or Nx1 (N pods doing both)
    policy: str = "longcap-dynamic"       # prefill policy (agentserving.prefill.POLICY_CLASSES)
    shadow: bool = True                   # wrap it in the ShadowScheduler (N+1 prefetch)
    routing: str | None = None            # default: kv-aware (agentserving), round-robin
    baseline_policy: str = "fcfs-chunk"   # the baseline's scheduler (vLLM-like chunked prefill)
    chunk: int = DEFAULT_CHUNK_SIZE
    rate: float | None = None             # root sessions/s (Poisson); None: trace start times
    time_scale: float = 1.0
    seed: int = 0
    sample_s: float = 5.0                 # occupancy/transfer time series interval
    load_penalty_tokens: int = 2048
    lookahead: int = 5                    # the ShadowScheduler's, as the service runs it
    prefetch_window: int = 1
    # Only predictions within prefetch_window trigger a prefetch (the one effect of the shadow's
    # look-ahead the simulator models), and they do not depend on how far the shadow looks:
    # by default it runs with lookahead=prefetch_window (same decisions and prefetches; the
    # other lookahead-prefetch_window decide calls per step were ~45% of a run). True: run them.
    full_lookahead: bool = False
    # Every pod runs the profile's engine scheduler (``Profile.engine``: the reference engine's
    # own FcfsPolicy, what `agentserving compare` runs on every worker) instead of the pure
    # prefill policies; the validation against a real bench run needs this.
    engine_scheduler: bool = False
    # Pods share the profile's host_cores (processor sharing) when it names any, with
    # host_background other runnable processes competing for them (see sim/host.py).
    host_sharing: bool = True
    host_background: float = 0.0
    host_background_roles: dict[str, float] | None = None   # per pod role ("prefill", ...)
    # Work per P/D hand-off besides its bytes, 0 unless measured (sim/validate.py fits it to a
    # run). On a shared host it is CPU work of the pull, slowed like the loops and slowing them:
    # on the reference engine a decode pod's loop polls every millisecond while a pull is on the
    # wire, and both ends frame, checksum and copy in Python; with no host, a plain wait.
    handoff_overhead_s: float = 0.0
    # The proxy's conditional disaggregation (``agentserving.proxy.disagg``, the same decision
    # function): a turn whose session's decode pod would compute at most this many prompt
    # tokens runs whole there; 0: every turn through the prefill pod (the proxy's first
    # design, and the validation runs taken with it). Decode pods then prefill with their own
    # scheduler: ``decode_scheduler`` in 256-token chunks (the bench's DECODE_POD_ARGS).
    local_prefill_tokens: int = 0
    # ... and the proxy's --max-prefill-backlog: any turn runs on a decode pod once every
    # prefill pod has this many turns in flight (0: no limit, the proxy's default)
    max_prefill_backlog: int = 0
    decode_scheduler: str = DECODE_POD_POLICY
    decode_chunk_tokens: int = DECODE_POD_CHUNK_TOKENS


class RefitEvery(StepTimeModel):
    """The shadow's step-time model, refitted every ``every`` observed steps instead of every
    step (a least-squares fit per step was ~5% of a large run). Its predictions only set the
    shadow's ETAs, which the simulator does not use (prefetch triggers on the predicted step
    offset), so no simulated result depends on how often it refits."""

    def __init__(self, *args: Any, every: int = 64, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.every = every
        self._seen = 0

    def fit(self) -> None:
        self._seen += 1
        if self._seen == 1 or self._seen % self.every == 0:
            super().fit()


def parse_topology(spec: str) -> tuple[int, int, int]:
    """(prefill, decode, both) pods: ``1P3D`` -> (1, 3, 0), ``4x1`` -> (0, 0, 4)."""
    m = re.fullmatch(r"(\d+)P(\d+)D", spec.strip(), re.I)
    if m:
        return int(m[1]), int(m[2]), 0
    m = re.fullmatch(r"(\d+)x1", spec.strip(), re.I)
    if m:
        return 0, 0, int(m[1])
    raise ValueError(f"topology {spec!r}: expected xPyD (e.g. 1P3D) or Nx1 (e.g. 4x1)")


class Req:
    __slots__ = ("rid", "turn", "send", "prompt", "out", "cached", "computed", "disk",
                 "view", "prefill_pod", "decode_pod", "first", "left", "ctx", "end",
                 "cached_actual", "state", "arrival_time", "handoff_at",
                 "decode_local", "local")

    def __init__(self, rid: str, turn: SimTurn, send: float) -> None:
        self.rid, self.turn, self.send = rid, turn, send
        self.prompt, self.out = turn.prompt_len, turn.output_len
        self.cached = self.computed = self.cached_actual = 0
        self.disk: tuple[str, ...] = ()
        self.view: ReqView | None = None
        self.prefill_pod = self.decode_pod = ""
        self.first: float | None = None
        self.end: float | None = None
        self.left = 0            # decode tokens still to produce on this pod
        self.ctx = 0
        # what the reference engine's own scheduler reads (engine.scheduler.policy)
        self.state = RequestState.WAITING
        self.arrival_time = send
        self.handoff_at: float | None = None   # P/D: when the decode pod got the request
        self.decode_local = 0    # P/D: leading chunks the decode pod already held
        self.local = False       # prefilled and decoded on the session's decode pod


class Pod:
    """A worker: prefill queue run by the policy, a decode batch, KV tiers."""

    def __init__(self, cluster: Cluster, name: str, role: PodRole, reuse: bool,
                 policy: Any) -> None:
        self.c, self.name, self.role, self.reuse = cluster, name, role, reuse
        p = cluster.profile
        hbm = p.tokens(p.memory.hbm_kv_gib)
        frac = p.memory.device_cache_fraction if reuse and role != PodRole.DECODE else 0.0
        self.kv_tokens = int(hbm * (1 - frac))
        cb = p.chunk_bytes(cluster.cfg.chunk)
        caps = {Tier.DEVICE: int(hbm * frac) // cluster.cfg.chunk,
                Tier.CPU: int(p.memory.dram_gib * 2**30 // cb) if reuse else 0,
                Tier.DISK: int(p.memory.ssd_gib * 2**30 // cb) if reuse else 0}
        self.tiers = PodTiers(name, caps, cb)
        # the N+1 prefetch's reads: one disk queue, a chunk landing in DRAM as its read ends
        self.reads = DiskReads(self.tiers, p.transfer_s(cb, p.bandwidth.disk_to_dram_gbps))
        self.policy = policy
        self.engine_policy = cluster.engine_policy   # the reference engine's own scheduler
        # the prefill queue, oldest first, kept incrementally (a saturated pod's queue holds
        # thousands of turns; rebuilding its views or scanning it per step made a long run
        # quadratic): rid -> Req, the policy's tuple of their views (None: rebuild on the next
        # step), and how many of them have a cached chunk on disk
        self.waiting: dict[str, Req] = {}
        self._wviews: tuple[ReqView, ...] | None = ()
        self._wdisk = 0
        self.prefilling: dict[str, Req] = {}
        self.decode_wait: deque[Req] = deque()
        self.decoding: dict[str, Req] = {}
        self.decode_kv = 0
        # turns in flight (waiting + prefilling + decode_wait + decoding), kept as they enter
        # and leave (routing reads every candidate's load for every turn)
        self.n_inflight = 0
        self._cands: dict[int, Candidate] = {}   # routing's view of this pod, per load
        self.busy = False
        self.pending = None          # the scheduled end of the current step/run
        self.run_start = 0.0         # decode-only run: when it started, step length, steps
        self.run_dt = 0.0
        self.run_k = 0
        self.extra_s = 0.0           # step-loop work owed by the next step (KV loads/stores)
        self.steps = 0
        self.busy_s = 0.0
        # forward passes' share of the current job, and their elapsed seconds so far (what the
        # engine's prefill_seconds + decode_seconds metrics add up; loads/stores excluded)
        self.fwd_share = 1.0
        self.fwd_s = 0.0
        self.step_factor = p.step_cost_factor.get(role.value, 1.0)
        roles = cluster.cfg.host_background_roles or {}
        self.background = roles.get(role.value, cluster.cfg.host_background)

    @property
    def inflight(self) -> int:
        """Turns in flight, counted (``n_inflight`` is the kept count the hot paths read)."""
        return len(self.waiting) + len(self.prefilling) + len(self.decode_wait) + \
            len(self.decoding)

    def candidate(self) -> Candidate:
        """This pod as the proxy's routing ``Candidate`` (frozen: one per load, reused)."""
        n = self.n_inflight
        c = self._cands.get(n)
        if c is None:
            c = self._cands[n] = Candidate(self.name, self.name, n)
        return c

    # ------------------------------------------------------------------ arrivals
    def submit_prefill(self, r: Req) -> None:
        now = self.c.loop.now
        chunk = self.c.cfg.chunk
        if self.reuse:
            limit = (r.prompt - 1) // chunk
            n, tiers = self.tiers.prefix(r.turn.chunks, limit)
            r.cached = n * chunk
            r.disk = tuple(h for h, t in zip(r.turn.chunks, tiers, strict=False)
                           if t is Tier.DISK)
        r.computed = r.cached
        r.view = ReqView(r.rid, r.send, r.prompt, computed=r.cached, disk_chunks=r.disk,
                         decode_left=(r.out - 1) if self.role == PodRole.BOTH or r.local
                         else 0)
        self.waiting[r.rid] = r
        self.n_inflight += 1
        if self._wviews is not None:
            self._wviews += (r.view,)
        if r.disk:
            self._wdisk += 1
        self._kick(now)

    def submit_decode(self, r: Req) -> None:
        r.left = r.out - 1
        r.ctx = r.prompt + 1
        if r.left <= 0:
            self.c.finish(r, self.c.loop.now)
            return
        self.decode_wait.append(r)
        self.n_inflight += 1
        self._kick(self.c.loop.now)

    # ------------------------------------------------------------------ stepping
    def _start_work(self, work: float, fn: Any, *args: Any) -> None:
        """Occupy the pod's step loop for ``work`` standalone seconds, then call ``fn``."""
        self.busy = True
        self.run_start = self.c.loop.now
        host = self.c.host
        if host is None:
            self.pending = self.c.loop.after(work, fn, *args)
        else:
            self.pending = None
            host.start(self, work, fn, *args, background=self.background)

    def _kick(self, now: float) -> None:
        if not self.busy:
            self._step()
            return
        if self.run_k <= 1:
            return
        # interrupt a decode-only run at the next step boundary
        host = self.c.host
        if host is None:
            if self.pending is None:
                return
            done = int((now - self.run_start) / self.run_dt)
            k = min(self.run_k, done + 1)
            if k < self.run_k:
                self.pending.cancel()
                self.run_k = k
                self.pending = self.c.loop.at(self.run_start + k * self.run_dt,
                                              self._end_run)
            return
        left = host.left(self)
        done = int((self.run_k * self.run_dt - left) / self.run_dt)
        k = min(self.run_k, done + 1)
        if k < self.run_k:
            host.set_left(self, left - (self.run_k - k) * self.run_dt)
            self.run_k = k

    def _admit_decodes(self) -> None:
        cap = self.engine_policy.max_running if self.engine_policy is not None else None
        while self.decode_wait:
            r = self.decode_wait[0]
            need = r.prompt + r.out
            if self.decoding and self.decode_kv + need > self.kv_tokens:
                break
            if cap is not None and len(self.decoding) >= cap:
                break
            self.decode_wait.popleft()
            self.decode_kv += need
            r.state = RequestState.DECODING
            self.decoding[r.rid] = r

    def _unwait(self, rid: str) -> Req:
        r = self.waiting.pop(rid)
        if r.disk:
            self._wdisk -= 1
        self._wviews = None
        return r

    def _state(self) -> SchedState:
        running = [r.view for r in self.prefilling.values()]
        running += [ReqView(r.rid, r.send, r.prompt, computed=r.ctx - 1, decode_left=r.left,
                            running=True) for r in self.decoding.values()]
        if self._wviews is None:
            self._wviews = tuple(r.view for r in self.waiting.values())  # type: ignore[misc]
        return SchedState(self._wviews, tuple(running),  # type: ignore[arg-type]
                          max_running=self.c.profile.max_running,
                          kv_capacity_tokens=self.kv_tokens, block_size=16,
                          now=self.c.loop.now)

    def _step(self) -> None:
        now = self.c.loop.now
        if self.role == PodRole.DECODE:
            self._admit_decodes()
        one_step = False  # a decode-only step the policy interleaves before the next chunk
        if self.waiting or self.prefilling:
            if self.engine_policy is not None:
                if self._engine_step(now):
                    return
                one_step = getattr(self.policy, "decode_steps", 1) > 1
            else:
                state = self._state()
                pol = self.policy
                if isinstance(pol, ShadowScheduler) and (
                        self.c.cfg.full_lookahead or self._wdisk):
                    res = pol.step(state)
                    d = res.decision
                    for _rid, hashes in res.prefetch:
                        self._prefetch(hashes, now)
                elif isinstance(pol, ShadowScheduler):
                    # no waiting request has a chunk on disk: the shadow's look-ahead can ask
                    # for no prefetch (its one modelled effect) and its decision is the wrapped
                    # policy's, so only that runs (same decision, same prefetches)
                    d = pol.policy.decide(state)
                    pol.prefetched.difference_update(d.admit)
                else:
                    d = self.policy.decide(state)
                if d.prefill:
                    self._prefill_step(d, state, now)
                    return
        if self.decoding:
            self._decode_run(now, 1 if one_step else None)
            return
        if self.extra_s:   # deferred KV stores still run on an otherwise idle loop
            extra, self.extra_s = self.extra_s, 0.0
            self.run_k = 1
            self.fwd_share = 0.0
            self._start_work(extra, self._end_idle_work, extra)
            return
        self.busy = False
        self.pending = None

    def _end_idle_work(self, work: float) -> None:
        self.busy_s += work
        self._step()

    def _prefetch(self, hashes: tuple[str, ...], now: float) -> None:
        reads = self.reads
        reads.prefetch(hashes, now)
        self.c.loop.at(reads.free_at, reads.settle, reads.free_at)
        self.c.stats["prefetch_chunks"] += len(hashes)

    def _load(self, r: Req) -> float:
        """Admission: read the cached prefix (still resident) from its tiers; seconds it takes
        (a prefix evicted since arrival is recomputed)."""
        p = self.c.profile
        n = self.tiers.prefix_len(r.turn.chunks, r.cached // self.c.cfg.chunk)
        src = self.tiers.use(r.turn.chunks[:n])
        r.cached_actual = n * self.c.cfg.chunk
        return self._load_s(src) + p.prefill.b_s * (r.cached - r.cached_actual)

    def _load_s(self, src: dict[Tier, int]) -> float:
        p = self.c.profile
        cb = self.tiers.chunk_bytes
        disk = src.get(Tier.DISK, 0) * cb
        return (p.transfer_s(src.get(Tier.CPU, 0) * cb, p.bandwidth.dram_to_device_gbps)
                + p.transfer_s(disk, p.bandwidth.disk_to_dram_gbps)
                + p.transfer_s(disk, p.bandwidth.dram_to_device_gbps))

    def _prefill_step(self, d: Any, state: SchedState, now: float) -> None:
        p = self.c.profile
        load_s = 0.0
        for rid in d.admit:
            r = self._unwait(rid)
            r.prefill_pod = self.name
            if r.cached:
                load_s += self._load(r)
            self.prefilling[rid] = r
        new = ctx = 0
        pairs = 0.0
        for rid, n in d.prefill:
            r = self.prefilling[rid]
            ctx += r.computed
            new += n
            pairs += n * (r.computed + (n + 1) / 2)
        dt = p.prefill_s(new, ctx) + load_s
        if p.prefill.d_s:
            dt += p.prefill.d_s * pairs
        if self.decoding:
            dt += p.decode_s(len(self.decoding), sum(r.ctx for r in self.decoding.values()))
        if self.step_factor != 1.0:
            dt = load_s + (dt - load_s) * self.step_factor
        if isinstance(self.policy, ShadowScheduler):
            # the shadow's features read only the stepped requests' views; with no decodes
            # in the step those are the prefilling turns' own (the same objects ``state``
            # holds), so pass just them instead of a saturated pod's whole queue per step
            if not d.decode:
                state = dataclasses.replace(state, waiting=(), running=tuple(
                    self.prefilling[rid].view for rid, _ in d.prefill))  # type: ignore[misc]
            self.policy.observe(*StepTimeModel.features(d, state), dt)
        fwd = dt - load_s
        dt += self._take_extra()
        self.fwd_share = fwd / dt if dt else 1.0
        self.run_k = 1
        self._start_work(dt, self._end_prefill_step, d.prefill, dt)

    def _take_extra(self) -> float:
        extra, self.extra_s = self.extra_s, 0.0
        return extra

    def _engine_step(self, now: float) -> bool:
        """One step of the reference engine (``engine.core.EngineCore.step``): its own policy
        plans on the queue; the engine's executor rules apply (admission while fewer than
        ``max_running`` hold KV, budgets rounded to whole chunks, the trailing partial chunk
        a pass of its own); every decoding request decodes one token in the same step."""
        p = self.c.profile
        eng = self.engine_policy
        chunk = self.c.cfg.chunk
        running = [*self.prefilling.values(), *self.decoding.values()]
        plan = self.policy.schedule(list(self.waiting.values()), running, SchedulerContext(
            chunk_size=chunk, max_running=eng.max_running, now=now))
        work = load_s = 0.0
        grants = []
        for w in plan.prefill:
            r = w.request
            if r.state is RequestState.WAITING:
                if len(self.prefilling) + len(self.decoding) >= eng.max_running:
                    continue
                self._unwait(r.rid)
                r.state = RequestState.PREFILLING
                r.prefill_pod = self.name
                if r.cached:
                    load = self._load(r)
                    work += load
                    load_s += load
                r.computed = r.cached_actual
                self.prefilling[r.rid] = r
            start = r.computed
            end = pass_end(start, r.prompt, w.num_tokens, chunk)
            work += p.chunk_s(end - start, start)
            grants.append((r.rid, end - start))
        if not grants:
            return False
        work += p.prefill.a_s
        if self.decoding:
            work += p.decode_s(len(self.decoding), sum(r.ctx for r in self.decoding.values()))
        if self.step_factor != 1.0:
            work = load_s + (work - load_s) * self.step_factor
        fwd = work - load_s
        work += self._take_extra()
        self.fwd_share = fwd / work if work else 1.0
        self.run_k = 1
        self._start_work(work, self._end_prefill_step, tuple(grants), work)
        return True

    def _end_prefill_step(self, grants: tuple[tuple[str, int], ...], dt: float) -> None:
        now = self.c.loop.now
        self.steps += 1
        self.busy_s += dt
        self.fwd_s += self.fwd_share * (dt if self.c.host is None else now - self.run_start)
        if self.decoding:
            self._advance_decodes(1, dt if self.c.host is None else now - self.run_start, now)
        for rid, n in grants:
            r = self.prefilling[rid]
            r.computed += n
            if r.view is not None:
                r.view = ReqView(r.rid, r.send, r.prompt, computed=r.computed, running=True,
                                 decode_left=r.view.decode_left)
            if r.computed >= r.prompt:
                del self.prefilling[rid]
                self.n_inflight -= 1
                if self.reuse:
                    new_chunks = self.tiers.store_new(r.turn.chunks)
                    self.extra_s += self.c.store_s(new_chunks)
                    self.c.flush(self)
                self.c.prefill_done(self, r, now)
        self._step()

    def _decode_run(self, now: float, max_steps: int | None = None) -> None:
        p = self.c.profile
        b = len(self.decoding)
        if self.extra_s or max_steps == 1:   # owed loads/stores: one step that carries them
            k = 1
            fwd = p.decode_s(b, sum(r.ctx for r in self.decoding.values())) * self.step_factor
            dt = fwd + self._take_extra()
            self.fwd_share = fwd / dt if dt else 1.0
        else:
            k = min(r.left for r in self.decoding.values())
            dt = p.decode_s(b, sum(r.ctx for r in self.decoding.values()) + b * k // 2) \
                * self.step_factor
            self.fwd_share = 1.0
        self.run_dt, self.run_k = dt, k
        if self.c.host is None:
            self.busy = True
            self.run_start = now
            self.pending = self.c.loop.at(now + k * dt, self._end_run)
        else:
            self._start_work(k * dt, self._end_run)

    def _end_run(self) -> None:
        now = self.c.loop.now
        k, dt = self.run_k, self.run_dt
        self.steps += k
        if self.c.host is None:
            self.busy_s += k * dt
            self.fwd_s += self.fwd_share * k * dt
            self._advance_decodes(k, dt, now)
        else:
            self.busy_s += now - self.run_start
            self.fwd_s += self.fwd_share * (now - self.run_start)
            self._advance_decodes(k, (now - self.run_start) / k, now)
        self._step()

    def _advance_decodes(self, k: int, dt: float, now: float) -> None:
        self.c.itl.append((dt, k * len(self.decoding)))
        for r in list(self.decoding.values()):
            r.left -= k
            r.ctx += k
            if r.first is None:   # P/D: the decode pod's first step answers the first token
                r.first = now - (k - 1) * dt
            if r.left <= 0:
                del self.decoding[r.rid]
                self.n_inflight -= 1
                self.decode_kv -= r.prompt + r.out
                if self.reuse and self.role == PodRole.BOTH:
                    self.tiers.store(r.turn.stored_chunks)
                    self.c.flush(self)
                elif self.reuse and self.role == PodRole.DECODE:
                    # the pulled prompt's full chunks stay here for the session's next turn;
                    # like the engine (_store_remote skips the reused prefix), only the chunks
                    # after the prefix found here at the hand-off are written
                    self.extra_s += self.c.store_s(self.tiers.store_new(
                        r.turn.chunks[r.decode_local:]))
                    self.c.flush(self)
                self.c.finish(r, now)


@dataclass
class SimResult:
    summary: dict[str, Any]
    records: list[dict[str, Any]]
    timeseries: dict[str, list[float]]
    stats: dict[str, Any] = field(default_factory=dict)


class Cluster:
    def __init__(self, sessions: list[SimSession], profile: Profile, cfg: SimConfig) -> None:
        self.cfg, self.profile, self.sessions = cfg, profile, sessions
        self.loop = EventLoop()
        clock = lambda: self.loop.now  # noqa: E731 - the index sees simulated time
        self.index = InMemoryIndex(clock=clock)
        self.state: dict[str, SessionState] = {}   # the proxy's memory of each session
        reuse = cfg.config == "agentserving"
        if cfg.config not in CONFIGS:
            raise ValueError(f"config {cfg.config!r}: expected one of {CONFIGS}")
        n_p, n_d, n_b = parse_topology(cfg.topology)
        if not reuse:  # the baseline: the same number of independent pods
            n_p, n_d, n_b = 0, 0, n_p + n_d + n_b
        self.host = Host(self.loop, profile.host_cores, cfg.host_background) if (
            profile.host_cores and cfg.host_sharing) else None
        self.engine_policy = None
        if cfg.engine_scheduler:
            if profile.engine is None:
                raise ValueError(f"profile {profile.name!r} has no engine section")
            if profile.engine.scheduler.partition("?")[0] != "fcfs":
                raise ValueError(f"engine scheduler {profile.engine.scheduler!r}: simulate "
                                 "the prefill policies with --policy (the same pure policy)")
            self.engine_policy = profile.engine
        self.routing = make_policy(cfg.routing or ("kv-aware" if reuse else "round-robin"),
                                   cfg.chunk, cfg.load_penalty_tokens)
        self.decode_routing = LeastLoaded()
        self.pods: dict[str, Pod] = {}
        for role, n, prefix in ((PodRole.PREFILL, n_p, "prefill"), (PodRole.DECODE, n_d, "decode"),
                                (PodRole.BOTH, n_b, "pod")):
            for i in range(n):
                name = f"{prefix}-{i}"
                self.pods[name] = Pod(self, name, role, reuse, self._policy(reuse)
                                      if role != PodRole.DECODE else self._decode_policy())
                run_sync(self.index.register_pod(PodRegistration(
                    pod=name, memory_api_url=f"http://{name}:6999", role=role,
                    model=profile.model), ttl_s=1e12))
        self.prefill_pods = [p for p in self.pods.values() if p.role != PodRole.DECODE]
        self.decode_pods = [p for p in self.pods.values() if p.role == PodRole.DECODE]
        self.records: list[dict[str, Any]] = []
        self.itl: list[tuple[float, int]] = []
        self.turn_end: dict[tuple[str, int], float] = {}
        self.children: dict[tuple[str, int], list[SimSession]] = {}
        self.remaining = sum(len(s.turns) for s in sessions)
        self.stats: dict[str, Any] = {"lookups": 0, "lookup_chunks": 0, "lookup_s": 0.0,
                                      "event_batches": 0, "chunk_events": 0, "index_chunk_ops": 0,
                                      "index_apply_s": 0.0,
                                      "route_best_tokens": 0, "route_chosen_tokens": 0,
                                      "prefetch_chunks": 0, "pod_to_pod_bytes": 0,
                                      "decode_ttft_s": 0.0}
        self.ts: dict[str, list[float]] = {"t": []}

    def _decode_policy(self) -> Any:
        """Decode pods prefill only the turns kept off the prefill pods (conditional
        disaggregation): the reference engine's scheduler as the bench's decode pods run it,
        or the pure chunked FCFS policy with the same chunk."""
        if not self.cfg.local_prefill_tokens:
            return None
        if self.engine_policy is not None:
            return make_engine_policy(self.cfg.decode_scheduler, self.cfg.decode_chunk_tokens)
        return build_policy("fcfs-chunk", chunk_tokens=self.cfg.decode_chunk_tokens)

    def _policy(self, reuse: bool) -> Any:
        if self.engine_policy is not None:
            return make_engine_policy(self.engine_policy.scheduler,
                                      self.engine_policy.prefill_chunk_tokens)
        if not reuse:
            return build_policy(self.cfg.baseline_policy,
                                **({"chunk_tokens": 2048} if self.cfg.baseline_policy ==
                                   "fcfs-chunk" else {}))
        pol = build_policy(self.cfg.policy)
        if self.cfg.shadow:
            p = self.profile.prefill
            cfg = self.cfg
            model = (StepTimeModel if cfg.full_lookahead else RefitEvery)(
                prior=(p.a_s, p.b_s, p.c_s))
            return ShadowScheduler(pol, lookahead=cfg.lookahead if cfg.full_lookahead
                                   else cfg.prefetch_window, prefetch_window=cfg.prefetch_window,
                                   model=model)
        return pol

    # ------------------------------------------------------------------ driving
    def run(self) -> SimResult:
        cfg = self.cfg
        if cfg.rate:
            with_poisson_starts(self.sessions, cfg.rate, cfg.seed)
        for s in self.sessions:
            if s.parent is None:
                self.loop.at((s.start_s or 0.0) * cfg.time_scale, self.start_turn, s, 0)
            else:
                self.children.setdefault((s.parent[0], s.parent[1]), []).append(s)
        self.loop.at(0.0, self.sample)
        wall = time.perf_counter()
        # the workload and the cluster are long-lived: keep them out of the collector's full
        # passes (each one walks every tracked object; a 100k-session run holds millions), and
        # collect the young generation less often (a run allocates millions of short-lived
        # containers and makes almost no reference cycles)
        gc.freeze()
        thresholds = gc.get_threshold()
        gc.set_threshold(max(thresholds[0], 50_000), *thresholds[1:])
        try:
            self.loop.run()
        finally:
            gc.set_threshold(*thresholds)
            gc.unfreeze()
        self.stats["wall_s"] = time.perf_counter() - wall
        self.stats["events"] = self.loop.processed
        return self.result()

    def start_turn(self, s: SimSession, k: int) -> None:
        turn = s.turns[k]
        r = Req(f"{s.session_id}/{k}", turn, self.loop.now)
        if k == 0 and s.parent is not None:   # the proxy's fork
            self.session(s.session_id).fork_from(self.session(s.parent[0]))
        pod, prefix = self.route(s.session_id, turn)
        local = self.local_pod(s, k, pod, prefix)
        if local is not None:
            r.local = True
            r.decode_local = len(turn.chunks)  # computed here: nothing to store at the end
            self.session(s.session_id).last_pod = local.name
            pod = local
        pod.submit_prefill(r)

    def local_pod(self, s: SimSession, k: int, prefill: Pod, prefix: int | None) -> Pod | None:
        """The proxy's conditional disaggregation, by the proxy's own planner
        (``plan_local_pod``) after routing: its one question, how many prompt tokens the routed
        prefill pod would compute, is answered from routing's lookup (``prefix``, that pod's
        chunks of the session's previous prompt). The simulated proxy hosts no sessions on
        prefill pods. The session's memory is the proxy's ``SessionState``."""
        cfg = self.cfg
        if not (cfg.local_prefill_tokens or cfg.max_prefill_backlog) or not self.decode_pods:
            return None
        state = self.session(s.session_id)
        name = state.last_decode_pod
        size = PromptSize(s.turns[k].prompt_len, None)
        own = self.pods[name].candidate() if name is not None else None
        routed = prefill.candidate()
        placement = Placement(
            size, None if own is None else state.held(cfg.chunk),
            own, [routed, *(p.candidate() for p in self.prefill_pods if p is not prefill)],
            [own or self.least_loaded_decode(s.session_id).candidate()], (),
            cfg.local_prefill_tokens, cfg.max_prefill_backlog)
        plan = plan_local_pod(placement)
        if plan.ask is not None:
            plan = plan_local_pod(placement, None if prefix is None
                                  else size.tokens - prefix * cfg.chunk)  # type: ignore[operator]
        if plan.pod is None:
            return None
        pod = self.pods[plan.pod.name]
        state.last_decode_pod = pod.name
        return pod

    def route(self, session_id: str, turn: SimTurn) -> tuple[Pod, int | None]:
        """The proxy's prefill choice; with it, the chosen pod's prefix of the session's
        previous chunks by the kvindex (None when there was no lookup)."""
        cands = [p.candidate() for p in self.prefill_pods]
        prefixes: dict[str, Any] = {}
        looked = False
        state = self.session(session_id)
        if self.routing.name == "kv-aware":
            chunks = state.chunk_hashes
            if chunks:
                t0 = time.perf_counter()
                found = run_sync(self.index.lookup(chunks, pods=[c.name for c in cands],
                                                   role=PodRole.PREFILL))
                ranked = rank_prefixes(found)
                self.stats["lookup_s"] += time.perf_counter() - t0
                self.stats["lookups"] += 1
                self.stats["lookup_chunks"] += len(chunks)
                prefixes = {p.pod: p for p in ranked}
                looked = True
        order = self.routing.rank(RouteInput(session_id, cands, prefixes, state.last_pod, True))
        pod = self.pods[order[0].name]
        chosen = prefixes[pod.name].prefix_chunks if pod.name in prefixes else 0
        if prefixes:
            self.stats["route_best_tokens"] += max(p.prefix_chunks for p in prefixes.values())
            self.stats["route_chosen_tokens"] += chosen
        state.last_pod = pod.name
        return pod, chosen if looked else None

    def session(self, sid: str) -> SessionState:
        """The proxy's memory of session ``sid`` (created on its first turn)."""
        state = self.state.get(sid)
        if state is None:
            state = self.state[sid] = SessionState()
        return state

    def least_loaded_decode(self, sid: str) -> Pod:
        """The proxy's decode choice (``LeastLoaded``: least load, then the session's last
        decode pod, then rendezvous order). Its sort keys are each candidate's own, so its
        first choice is among the least loaded: only those are ranked (the same choice, without
        hashing the session with every pod of a large pool). The simulated pods report no
        queued prompt tokens (the proxy counts those of the turns it runs whole on a pod), so
        load here is turns in flight alone: the proxy's order whenever nothing is queued. The
        proxy places a session's first turn by its decode pods' recent work plus their
        load (``proxy.pod_activity``); the simulated pods carry none (``recent_work`` 0), so
        here a new session goes by load alone, as the proxy placed it before."""
        least = min(p.n_inflight for p in self.decode_pods)
        cands = [p.candidate() for p in self.decode_pods if p.n_inflight == least]
        return self.pods[self.decode_routing.rank(RouteInput(
            sid, cands, last_pod=self.session(sid).last_decode_pod))[0].name]

    def flush(self, pod: Pod) -> None:
        raw = pod.tiers.raw_events
        batch = pod.tiers.flush()
        if batch is None:
            return
        t0 = time.perf_counter()
        res = run_sync(self.index.apply_events(batch))
        self.stats["index_apply_s"] += time.perf_counter() - t0
        self.stats["event_batches"] += 1
        # chunk_events: the residency changes the pod reported (one per chunk per tier move);
        # index_chunk_ops: what the index applied after netting per (chunk, tier) in a batch
        self.stats["chunk_events"] += raw - pod.tiers.flushed_raw
        pod.tiers.flushed_raw = raw
        self.stats["index_chunk_ops"] += res.chunk_events

    def prefill_done(self, pod: Pod, r: Req, now: float) -> None:
        if pod.role == PodRole.BOTH or r.local:
            r.first = now
            r.decode_pod = pod.name
            r.left = r.out - 1
            r.ctx = r.prompt + 1
            if r.left <= 0:
                self.finish(r, now)
            else:
                r.state = RequestState.DECODING
                pod.decoding[r.rid] = r
                pod.n_inflight += 1
                if r.local:
                    pod.decode_kv += r.prompt + r.out
            return
        sid = r.turn.session_id
        dec = self.least_loaded_decode(sid)
        self.session(sid).last_decode_pod = dec.name
        local = 0
        if dec.reuse:
            # the decode pod pulls only what it does not hold from the session's last turn
            n = dec.tiers.prefix_len(r.turn.chunks, len(r.turn.chunks))
            if n:
                dec.extra_s += dec._load_s(dec.tiers.use(r.turn.chunks[:n]))
                self.flush(dec)
            local = n * self.cfg.chunk
            r.decode_local = n
        nbytes = (r.prompt - local) * self.profile.kv_bytes_per_token
        self.stats["pod_to_pod_bytes"] += nbytes
        dt = self.profile.transfer_s(nbytes, self.profile.bandwidth.pod_to_pod_gbps)
        r.decode_pod = dec.name
        r.handoff_at = now
        extra = self.cfg.handoff_overhead_s
        if self.host is None:
            self.loop.at(now + extra + dt, dec.submit_decode, r)
        else:
            # on a shared host the pull is CPU work (framing, checksums, copies at both ends,
            # the decode pod's loop polling for it), slowed like the loops and slowing them
            self.host.start(("pull", r.rid), dt + extra, dec.submit_decode, r,
                            background=dec.background)

    def store_s(self, chunks: int) -> float:
        """Step-loop seconds to write ``chunks`` newly computed chunks into the KV tiers."""
        bw = self.profile.bandwidth.device_to_dram_gbps
        if not bw or not chunks:
            return 0.0
        return self.profile.transfer_s(chunks * self.profile.chunk_bytes(self.cfg.chunk), bw)

    def finish(self, r: Req, now: float) -> None:
        r.end = now
        if r.handoff_at is not None:   # what a decode worker's ttft_seconds metric measures
            self.stats["decode_ttft_s"] += (r.first or now) - r.handoff_at
        elif r.local:                  # ... for a turn it prefilled itself: from arrival
            self.stats["decode_ttft_s"] += (r.first or now) - r.send
        t = r.turn
        state = self.session(t.session_id)
        state.prompt_tokens = r.prompt
        state.chunk_hashes = t.stored_chunks   # what the pods return for the turn
        self.remaining -= 1
        self.records.append({
            "session_id": t.session_id, "turn": t.index, "last_turn": t.last, "ok": True,
            "start_s": r.send, "end_s": now, "ttft_s": (r.first or now) - r.send,
            "e2e_s": now - r.send, "itl_s": [], "prompt_tokens": r.prompt,
            "cached_tokens": r.cached_actual, "completion_tokens": r.out,
            "appended_tokens": t.appended, "ideal_cached_tokens": t.ideal_cached,
            "prefill_pod": r.prefill_pod, "decode_pod": r.decode_pod})
        s_turns = self._session_turns(t.session_id)
        gap = t.tool_gap_s * self.cfg.time_scale
        if t.index + 1 < len(s_turns.turns):
            nxt = s_turns.turns[t.index + 1]
            when = now + gap
            if nxt.timestamp_s is not None and s_turns.start_s is not None:
                when = max(when, (nxt.timestamp_s - 0.0) * self.cfg.time_scale)
            self.loop.at(when, self.start_turn, s_turns, t.index + 1)
        for child in self.children.get((t.session_id, t.index), []):
            self.loop.at(max(now + child.parent[2] * self.cfg.time_scale,  # type: ignore[index]
                             (child.start_s or 0.0) * self.cfg.time_scale),
                         self.start_turn, child, 0)

    def _session_turns(self, sid: str) -> SimSession:
        if not hasattr(self, "_by_id"):
            self._by_id = {s.session_id: s for s in self.sessions}
        return self._by_id[sid]

    def sample(self) -> None:
        ts = self.ts
        ts["t"].append(self.loop.now)
        cb = self.profile.chunk_bytes(self.cfg.chunk)
        for tier in (Tier.DEVICE, Tier.CPU, Tier.DISK):
            key = f"occupancy_bytes_{tier.value}"
            ts.setdefault(key, []).append(
                float(sum(p.tiers.count(tier) for p in self.pods.values()) * cb))
        moved: dict[str, int] = {}
        for p in self.pods.values():
            for k, v in p.tiers.moved.items():
                moved[k] = moved.get(k, 0) + v
        for k in ("device_to_dram", "dram_to_disk", "disk_to_dram", "dram_to_device",
                  "disk_to_device"):
            ts.setdefault(f"moved_bytes_{k}", []).append(float(moved.get(k, 0)))
        ts.setdefault("moved_bytes_pod_to_pod", []).append(float(self.stats["pod_to_pod_bytes"]))
        ts.setdefault("queued_turns", []).append(
            float(sum(len(p.waiting) + len(p.decode_wait) for p in self.pods.values())))
        if self.remaining > 0:
            self.loop.after(self.cfg.sample_s, self.sample)

    # ------------------------------------------------------------------ results
    def result(self) -> SimResult:
        planned = sum(len(s.turns) for s in self.sessions)
        ideal_prompt = sum(t.prompt_len for s in self.sessions for t in s.turns)
        ideal = sum(t.ideal_cached for s in self.sessions for t in s.turns)
        summary = summarize(self.records, sessions_planned=len(self.sessions),
                            turns_planned=planned,
                            ideal_hit_rate=ideal / ideal_prompt if ideal_prompt else None)
        summary["itl_p99_s"] = weighted_percentile(self.itl, 99)
        st = self.stats
        st["route_prefix_efficiency"] = (st["route_chosen_tokens"] / st["route_best_tokens"]
                                         if st["route_best_tokens"] else None)
        st["pods"] = {p.name: {"role": p.role.value, "steps": p.steps,
                               "busy_s": round(p.busy_s, 3)} for p in self.pods.values()}
        st["forward_s"] = sum(p.fwd_s for p in self.pods.values())
        st["forward_s_by_role"] = {}
        for p in self.pods.values():
            by = st["forward_s_by_role"]
            by[p.role.value] = by.get(p.role.value, 0.0) + p.fwd_s
        if self.host is not None:
            st["host_busy_core_s"] = self.host.busy_core_s
        summary["sim"] = {k: v for k, v in st.items() if k != "pods"}
        return SimResult(summary, self.records, self.ts, st)


def weighted_percentile(pairs: list[tuple[float, int]], q: float) -> float | None:
    """The q-th percentile of values given as (value, count) pairs (inverted CDF)."""
    pairs = [(v, n) for v, n in pairs if n > 0]
    if not pairs:
        return None
    vals = np.array([v for v, _ in pairs])
    counts = np.array([n for _, n in pairs], dtype=float)
    order = np.argsort(vals, kind="stable")
    cum = np.cumsum(counts[order])
    idx = int(np.searchsorted(cum, q / 100 * cum[-1], side="left"))
    return float(vals[order][min(idx, len(vals) - 1)])


def simulate(sessions: list[SimSession], profile: Profile, cfg: SimConfig) -> SimResult:
    """Run one configuration over ``sessions`` (compiled by ``workload.compile_trace``)."""
    # with_poisson_starts rewrites start_s only; turns are never mutated, so a shallow copy of
    # each session keeps the caller's list reusable (a deepcopy of every turn cost ~5% of a run)
    return Cluster([dataclasses.replace(s) for s in sessions] if cfg.rate else sessions,
                   profile, cfg).run()
