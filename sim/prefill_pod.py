"""One prefill pod under a scheduling policy, on simulated time: the scheduling study's replay
(``bench/prefill_sched_bench.py``, docs/scheduling.md).

It steps the *real* policy and ``ShadowScheduler`` objects (``agentserving.prefill``) over a
``sim.prefill_trace`` arrival trace, with the engine's pass rule (``prefill.policies.executor``:
256-token quantum, the trailing partial chunk a pass of its own), step times from a fitted
``StepTimeModel`` times seeded noise and stalls, and the pod's KV in the simulator's tier model
(``sim.tiers.PodTiers``: DRAM over disk) with the prefetches timed on one disk queue
(``sim.tiers.DiskReads``). The caller's side of a prefetch is modelled too: prefetched chunks
pinned in DRAM until their turn's admission, and an admission that waits for a chunk still in
flight rather than reading it from disk again. Exposed KV time counts all admission load time
(no layer-wise overlap is modelled).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from agentserving.core.schemas import Tier
from agentserving.prefill.policies import ReqView, SchedState, advance
from agentserving.prefill.policies.executor import pass_limit
from agentserving.prefill.shadow import PrefetchScore, ShadowScheduler, StepTimeModel, WindowScore
from agentserving.sim.prefill_trace import CHUNK, TURN_MIX, Turn, pct
from agentserving.sim.tiers import DiskReads, PodTiers

_CPU = Tier.CPU
_EVERY_CHUNK = 1 << 62  # the disk's size in chunks: it never evicts


def turn_work(x: Turn, model: StepTimeModel, split_tail: bool = False) -> float:
    """Seconds of compute one turn needs under fcfs no-chunk, its step overhead ``a``
    included (an upper bound: fcfs batches short turns, sharing ``a``). With ``split_tail``
    the trailing partial chunk is a chunk of its own (the engine rule), which re-reads the
    context once more."""
    pieces, start = [], x.cached
    end = pass_limit(start, x.prompt, CHUNK, split_tail)
    if end < x.prompt:
        pieces.append((end - start, start))
        start = end
    pieces.append((x.prompt - start, start))
    return sum(model.predict(n, s, StepTimeModel.chunk_pairs(n, s)) for n, s in pieces)


def service_estimate(trace: list[Turn], model: StepTimeModel, env: Env | None = None,
                     split_tail: bool = False) -> float:
    """Mean seconds of work per turn; with ``env``, its per-sequence cost and the mean stall
    slow-down included (so ``--load`` stays the load the pod actually sees)."""
    work = float(np.mean([turn_work(x, model, split_tail) for x in trace]))
    if env is not None:
        work = (work + env.per_seq_s) * (1 + env.stall_prob * (env.stall_factor - 1))
    return work


@dataclasses.dataclass(frozen=True)
class Env:
    """What makes the shadow's prediction non-trivial (each a real source on a pod):
    step times off the shadow's model (lognormal noise, occasional stalls, a per-sequence cost
    the model lacks), arrivals during a step (Poisson: they may overtake waiting turns in the
    short band), and DRAM pressure (LRU of ``dram_chunks``, filled by restored and newly
    computed KV, so a prefetched chunk can be evicted before its turn is admitted)."""

    noise: float = 0.0
    stall_prob: float = 0.0
    stall_factor: float = 3.0
    per_seq_s: float = 0.0
    dram_chunks: int = 1500
    store_new_kv: bool = False
    # the caller's side of the prefetch (what the engine does with the shadow's requests):
    pin_prefetch: bool = False      # pin prefetched chunks until their turn's admission
    pin_share: float = 0.75         # at most this share of DRAM pinned
    wait_in_flight: bool = False    # at admission, wait for a chunk still being prefetched
                                    # (else it is read from disk a second time)


def replay(policy: Any, trace: list[Turn], model: StepTimeModel, kv: dict[str, float],
           shadow: ShadowScheduler | None = None, noise: float = 0.0,
           seed: int = 0, split_tail: bool = True, env: Env | None = None,
           kv_capacity_tokens: int = 512 * 1024, keep_turns: bool = False) -> dict[str, Any]:
    """Replay ``trace`` on one pod. A step's forward time is the fitted model's times a
    seeded mean-one lognormal factor (sigma ``noise``), and ``env``'s stalls and per-sequence
    cost: the shadow predicts from its own model, fitted online from those measured steps,
    as in the engine."""
    env = env or Env(noise=noise)
    noise = env.noise
    noise_rng = np.random.default_rng(seed)
    chunks = {x.rid: tuple(f"{x.rid}/{k}" for k in range(x.cached // CHUNK)) for x in trace}
    # DRAM (LRU, ``env.dram_chunks``) over a disk that holds every context
    tiers = PodTiers("prefill", {Tier.CPU: env.dram_chunks, Tier.DISK: _EVERY_CHUNK}, 1)
    where = tiers.where
    reads = DiskReads(tiers, disk_s=kv["disk"], pin_share=env.pin_share)
    pins: dict[str, tuple[str, ...]] = {}  # rid -> its pinned prefetched chunks
    for x in trace:  # contexts start on disk, the latest chunks of some also in DRAM
        tiers.place(chunks[x.rid], Tier.DISK)
        if not x.on_disk:
            tiers.store(list(chunks[x.rid][-8:]))
    s = SchedState((), (), max_running=32, kv_capacity_tokens=kv_capacity_tokens,
                   block_size=CHUNK,
                   quantum=CHUNK, split_tail=split_tail)
    now, i, done = 0.0, 0, {}
    arrival = {x.rid: x.arrival for x in trace}
    forward, exposed, pending_pred = [], [], None
    pred_log: dict[str, list[tuple[int, Any]]] = {}  # rid -> (step made, Prediction)
    horizon: dict[int, list[int]] = {}                # offset -> [exact, predictions]
    made_at: dict[int, float] = {}
    eta_err: list[float] = []
    conf, pf_score = WindowScore(), PrefetchScore()
    prefetched: dict[str, tuple[str, ...]] = {}
    admitted_at: dict[str, float] = {}
    while len(done) < len(trace):
        while i < len(trace) and trace[i].arrival <= now:
            x = trace[i]
            reads.settle(now)
            disk = tuple(h for h in chunks[x.rid] if where[h] is not _CPU)
            v = ReqView(x.rid, x.arrival, x.prompt, computed=x.cached, disk_chunks=disk)
            s = dataclasses.replace(s, waiting=s.waiting + (v,))
            i += 1
        if not s.waiting and not s.running:
            now = trace[i].arrival
            continue
        if shadow is not None:
            res = shadow.step(s)
            d = res.decision
            if pending_pred is not None:  # score the last step's N+1 prediction
                conf.add(*pending_pred, set(d.admit))
            pending_pred = (res.window,
                            [w.req_id for w in s.waiting])
            step_no = len(forward)
            for rid in d.admit:  # score every earlier look-ahead prediction of this admission
                for made, pr in pred_log.pop(rid, []):
                    off = horizon.setdefault(pr.offset, [0, 0])
                    off[0] += made + pr.offset == step_no
                    off[1] += 1
                    if pr.offset == 1:
                        eta_err.append(pr.eta_s - (now - made_at[made]))
            made_at[step_no] = now
            for rid, pr in res.predictions.items():
                pred_log.setdefault(rid, []).append((step_no, pr))
            for rid, hashes in res.prefetch:
                if env.pin_prefetch:
                    # pinned until admission, even when overtaken since (a turn once in
                    # the N+1 window comes soon); chunks that find the pins full (``pin_share``
                    # of DRAM) land unpinned, in the LRU
                    pins[rid] = hashes
                reads.prefetch(hashes, now, pin=env.pin_prefetch)
                prefetched[rid] = hashes
                pf_score.chunks += len(hashes)
        else:
            d = policy.decide(s)
        fwd = model.predict_step(d, s) + env.per_seq_s * len(d.prefill)
        if noise > 0:
            fwd *= float(noise_rng.lognormal(-noise * noise / 2, noise))
        if env.stall_prob and noise_rng.random() < env.stall_prob:
            fwd *= env.stall_factor
        if shadow is not None:
            shadow.observe_step(d, s, fwd)
        load = 0.0
        for rid in d.admit:
            admitted_at[rid] = now
            pf = set(prefetched.pop(rid, ()))
            reads.settle(now)
            for h in chunks[rid]:
                land = reads.landing(h) if h in pf else None
                landed = h in pf and land is None
                hit = where[h] is _CPU
                waited = False
                if not hit and env.wait_in_flight and land is not None:
                    waited = True  # still on its way: wait for it, not a 2nd read
                    load = max(load, land - now)
                load += kv["cpu"] if hit or waited else kv["disk"]
                if h in pf:  # used: the prefetch saved a disk read; alive: landed, not evicted
                    pf_score.add(0, used=hit or waited, landed=landed, alive=landed and hit)
                tiers.use((h,))  # read into DRAM (one by one: a read may evict the next)
            if rid in pins:  # restored: the pins' job is done
                reads.unpin(pins.pop(rid))
        if env.store_new_kv:  # LMCache stores each newly computed full chunk in DRAM
            comp = {r.req_id: r.computed for r in s.running + s.waiting}
            for rid, n in d.prefill:
                tiers.store([f"{rid}/{k}" for k in
                             range(comp[rid] // CHUNK, (comp[rid] + n) // CHUNK)])
        forward.append(fwd)
        exposed.append(load)  # no layer-wise overlap in the engine yet: all of it exposed
        full = advance(s, d, drop_finished=False)
        now += fwd + load
        s = advance(s, d)
        left = {r.req_id for r in s.running}
        for r in full.running:
            if r.req_id not in left:
                done[r.req_id] = now - arrival[r.req_id]
    lat = list(done.values())
    kind = {x.rid: x.kind for x in trace}
    by_kind = {k: [v for rid, v in done.items() if kind[rid] == k] for k in TURN_MIX}
    new = {x.rid: x.prompt - x.cached for x in trace}
    bounds = [(0, 512), (512, 2048), (2048, 4096), (4096, 1 << 40)]
    by_new = {f"{lo}-{hi if hi < 1 << 40 else 'inf'}": [v for rid, v in done.items()
                                                        if lo < new[rid] <= hi]
              for lo, hi in bounds}
    out: dict[str, Any] = {
        "latency_s": {"p50": pct(lat, 50), "p85": pct(lat, 85), "p95": pct(lat, 95),
                      "p99": pct(lat, 99), "mean": float(np.mean(lat))},
        "latency_p50_by_kind_s": {k: pct(v, 50) for k, v in by_kind.items()},
        "latency_by_new_tokens_s": {k: {"n": len(v), "p50": pct(v, 50), "p95": pct(v, 95)}
                                    for k, v in by_new.items()},
        "steps": len(forward), "makespan_s": now,
        "utilization": float(sum(forward) + sum(exposed)) / now,
        "forward_s": {"p50": pct(forward, 50), "p95": pct(forward, 95)},
        "exposed_kv_s": {"p50": pct(exposed, 50), "p95": pct(exposed, 95)},
    }
    if keep_turns:  # per-turn latencies (analysis, not written to the JSON)
        out["turn_latency_s"] = dict(done)
        out["turn_wait_s"] = {rid: admitted_at[rid] - arrival[rid] for rid in done}
    if shadow is not None:
        out["n_plus_1_prediction"] = {
            **conf.as_dict(),
            # every N+k prediction (k = 1..lookahead): admitted at exactly step N+k?
            "exact_step_by_offset": {k: v[0] / v[1] for k, v in sorted(horizon.items())},
            "predictions_by_offset": {k: v[1] for k, v in sorted(horizon.items())},
            # predicted minus actual seconds until an N+1-predicted admission (the shadow's
            # online-fitted model vs the noisy simulated steps)
            "n1_eta_error_s": {"p50_abs": pct([abs(e) for e in eta_err], 50),
                               "p95_abs": pct([abs(e) for e in eta_err], 95),
                               "mean": float(np.mean(eta_err)) if eta_err else float("nan")}}
        # consumption precision: prefetched chunks read from DRAM at their turn's admission
        # (lost when evicted first, or still in flight: then read from disk again);
        # survival: of the prefetched chunks that had landed by admission, those still in
        # DRAM (lost only to eviction)
        out["prefetch"] = pf_score.as_dict()
    return out
