"""Prefill scheduling: fcfs (no chunk) vs fcfs + fixed chunk (Sarathi) vs Longcap-FCFS +
Dynamic Chunk, and the ShadowScheduler's N+1 prefetch, on one prefill worker (issue 4).

    python -m bench prefill_sched [--quick] [--out bench/results/prefill_sched.json]

What is measured and what is simulated (also written into the JSON):
1. measured on the real engine: a calibration run of the reference engine's model runner
   (tiny random-weight Llama on the CPU) over prefill chunks of several sizes and contexts;
   the step-time model (seconds ~ a + b*new + c*context, least squares, the ShadowScheduler's
   own ``StepTimeModel``) is fitted from it; LMCache load seconds per 256-token chunk from
   DRAM and from disk (``KVStore.load_prefix``).
2. simulated: the same Poisson arrival trace of agent turns replayed against each policy on
   one prefill pod, stepping the *real* policy and ShadowScheduler objects with step times
   from the fitted model (the engine's rules mirrored: 256-token quantum, trailing partial
   chunk split) and a DRAM/disk tier model with the measured per-chunk load costs. The
   caller's side of a prefetch is modelled too: prefetched chunks pinned in DRAM until their
   turn's admission (``--no-pin``), and an admission that waits for a chunk still in flight
   rather than reading it from disk again (``--no-wait-in-flight``).
3. NOT YET IMPLEMENTED: a small real-engine run for exposed KV time. The exposed-KV numbers
   in the JSON are simulated, and count all admission load time as exposed (the engine
   has no layer-wise overlap yet).
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import itertools
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from agentserving.core.hashing import DEFAULT_CHUNK_SIZE
from agentserving.prefill.policies import (
    FcfsChunk,
    FcfsNoChunk,
    LongcapDynamic,
    ReqView,
    SchedState,
    advance,
)
from agentserving.prefill.policies.executor import pass_limit
from agentserving.prefill.shadow import (
    SEED_003_N1,
    PrefetchScore,
    ShadowScheduler,
    StepTimeModel,
    WindowScore,
)
from bench.common import write_result

CHUNK = DEFAULT_CHUNK_SIZE


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench prefill_sched", description=__doc__)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--load", type=float, default=0.95, help="Offered load vs fcfs capacity.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lookahead", type=int, default=5)
    p.add_argument("--noise", type=float, default=0.2,
                   help="Sigma of the mean-one lognormal factor on simulated step times.")
    p.add_argument("--stall-prob", type=float, default=0.02,
                   help="Share of steps that stall (host contention, GC): x --stall-factor.")
    p.add_argument("--stall-factor", type=float, default=3.0)
    p.add_argument("--per-seq-s", type=float, default=0.002,
                   help="Seconds per sequence in a step, a cost the shadow's step-time model "
                        "does not have (its fit absorbs it only on average).")
    p.add_argument("--dram-chunks", type=int, default=400,
                   help="DRAM tier size in 256-token chunks (LRU); new KV is stored there too, "
                        "so prefetched chunks can be evicted before their admission.")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="Do not pin prefetched chunks in DRAM until their turn's admission.")
    p.add_argument("--no-wait-in-flight", dest="wait_in_flight", action="store_false",
                   help="At admission, read a chunk whose prefetch is still in flight from "
                        "disk a second time instead of waiting for it.")
    p.add_argument("--robust", type=float, default=0.5,
                   help="The shadow-robust variant's survival threshold (ShadowScheduler "
                        "robust=).")
    p.add_argument("--sweep", action="store_true", help="Also sweep longcap's parameters.")
    p.add_argument("--no-split-tail", dest="split_tail", action="store_false",
                   help="Executor without the reference engine's trailing-partial-chunk "
                        "split (vLLM-like, as in seed 003).")
    p.add_argument("--calibration", type=Path, default=None,
                   help="Reuse the calibration of an earlier result JSON (no measuring).")
    p.add_argument("--quick", action="store_true", help="Smoke sizes (CI).")
    p.add_argument("--out", type=Path, default=Path("bench/results/prefill_sched.json"))
    a = p.parse_args(argv)
    if a.quick:
        a.requests = 1000
    return a


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs, dtype=float), q)) if xs else float("nan")


# ------------------------------------------------------------------ 1. calibration (real)

CALIBRATION_REPEATS = 3


def calibrate(quick: bool) -> dict[str, Any]:
    """The step-time model and KV load costs, measured on the real engine (sim's calibration)."""
    from agentserving.sim.calibrate import measure

    runs = [measure(quick=quick) for _ in range(CALIBRATION_REPEATS)]
    m = runs[0]
    # single-shot CPU timings are noisy: keep each (new, context) point's fastest repeat
    rows = [min(rs, key=lambda r: r["seconds"]) for rs in zip(*(x["prefill_rows"] for x in runs),
                                                              strict=True)]
    # refit with the attention term (each row is one chunk: n new tokens from start s)
    model = StepTimeModel(attention=True, min_samples=1)
    for r in rows:
        model.observe(r["new_tokens"], r["context_tokens"], r["seconds"])
    a, b, c, d = (float(v) for v in model.coef)
    err = [abs(model.predict(r["new_tokens"], r["context_tokens"]) - r["seconds"])
           / r["seconds"] for r in rows]
    return {"rows": rows, "coef": {"a_s": a, "b_s_per_new_token": b,
                                   "c_s_per_context_token": c, "d_s_per_attention_pair": d},
            "coef_3term_sim_profile": m["prefill_coef"], "fit_max_rel_err": max(err),
            "repeats": CALIBRATION_REPEATS,
            "kv_load_s_per_chunk": {k: min(x["kv_load_s_per_chunk"][k] for x in runs)
                                    for k in ("cpu", "disk")}}


# ------------------------------------------------------------------ 2. replay (simulated)

@dataclasses.dataclass
class Turn:
    rid: str
    arrival: float
    prompt: int
    cached: int
    on_disk: bool
    kind: str = ""


# Seed 003's evaluation set (section 10): 1,999 trajectories = LMSYS-Chat 600 + WildChat 600 +
# MTRAG 300 + SWE-bench 300 + LongBench 200, 12,740 turns in all (section 5). Turns per
# trajectory are assumed (not in the seed): chat 2.5, MTRAG 7.5, LongBench 1 (single-shot
# long documents), SWE-bench the rest, (12740 - 1200*2.5 - 300*7.5 - 200) / 300 ~ 24. The token
# shapes per turn are assumptions too (see docs/scheduling.md): (share of turns, sampler).
def _chat(rng: random.Random) -> tuple[int, int]:
    # user message + the previous reply (not cached on a P/D prefill pod) over a short history
    return _clip(rng.lognormvariate(5.9, 0.8), 16, 4096), rng.randint(0, 16) * CHUNK


def _rag(rng: random.Random) -> tuple[int, int]:
    # question + retrieved passages (a few ~200-token passages) over the conversation so far
    return _clip(rng.lognormvariate(6.7, 0.5), 128, 8192), rng.randint(4, 48) * CHUNK


def _swe(rng: random.Random) -> tuple[int, int]:
    if rng.random() < 1 / 24:  # first turn: tools + issue text over a shared system prompt
        return rng.randint(12, 32) * CHUNK, 8 * CHUNK
    # a tool result (file views, test logs: heavy tail) over a growing context
    return _clip(rng.lognormvariate(6.2, 1.0), 32, 16384), rng.randint(16, 160) * CHUNK


def _longdoc(rng: random.Random) -> tuple[int, int]:
    # LongBench: one long document + question, nothing cached
    return rng.randint(32, 128) * CHUNK, 0


TURN_MIX: dict[str, tuple[float, Any]] = {
    "chat": (3000 / 12740, _chat), "rag": (2250 / 12740, _rag),
    "swe": (7290 / 12740, _swe), "longdoc": (200 / 12740, _longdoc)}


def _clip(x: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, x)))


def make_trace(n: int, rate: float, seed: int) -> list[Turn]:
    """Poisson arrivals of agent turns drawn from the seed-like ``TURN_MIX``: many short turns
    appending a few hundred tokens to a cached context, a few very long prefills (first SWE
    turns, big tool outputs, long documents) that block everything behind them under fcfs."""
    rng = random.Random(seed)
    kinds = list(TURN_MIX)
    weights = [TURN_MIX[k][0] for k in kinds]
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        kind = rng.choices(kinds, weights)[0]
        new, cached = TURN_MIX[kind][1](rng)
        out.append(Turn(f"t{i}", t, cached + new, cached, rng.random() < 0.5, kind))
    return out


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


def trace_summary(trace: list[Turn], short_tokens: int) -> dict[str, Any]:
    new = np.array([x.prompt - x.cached for x in trace])
    return {"turns_by_kind": {k: sum(x.kind == k for x in trace) for k in TURN_MIX},
            "new_tokens": {"p50": pct(list(new), 50), "p90": pct(list(new), 90),
                           "p99": pct(list(new), 99), "max": int(new.max())},
            "cached_tokens_p50": pct([x.cached for x in trace], 50),
            "long_share": float(np.mean(new > short_tokens)),
            "short_tokens": short_tokens}


class Tiers:
    """DRAM (LRU, in chunks) over disk; a single disk queue serves prefetches. A prefetched
    chunk enters DRAM (and the LRU order) when it lands, so it can be evicted between landing
    and its turn's admission, unless it is pinned: a pinned chunk counts against the DRAM
    size but is never evicted until it is unpinned (then it joins the LRU as most recent).
    At most ``pin_share`` of DRAM is pinned; a landing chunk past that joins the LRU."""

    def __init__(self, dram_chunks: int, disk_s: float, pin_share: float = 0.75) -> None:
        self.cap = dram_chunks
        self.lru: dict[str, None] = {}
        self.pinned: set[str] = set()
        self.pin_cap = int(dram_chunks * pin_share)
        self._pin_wanted: set[str] = set()
        self.disk_s = disk_s
        self.disk_free_at = 0.0
        self.arrive: dict[str, float] = {}  # chunk -> time its prefetch lands (in flight)
        self._landing: list[tuple[float, str]] = []  # heap of (land time, chunk)

    def put(self, h: str) -> None:
        if h in self.pinned:
            return
        self.lru.pop(h, None)
        self.lru[h] = None
        while self.lru and len(self.lru) + len(self.pinned) > self.cap:
            self.lru.pop(next(iter(self.lru)))

    def unpin(self, hashes: tuple[str, ...]) -> None:
        for h in hashes:
            self._pin_wanted.discard(h)
            if h in self.pinned:
                self.pinned.discard(h)
                self.put(h)

    def settle(self, now: float) -> None:
        """Land every prefetch due by ``now``, in landing order."""
        while self._landing and self._landing[0][0] <= now:
            land, h = heapq.heappop(self._landing)
            if self.arrive.get(h) == land:
                del self.arrive[h]
                if h in self._pin_wanted and len(self.pinned) < self.pin_cap:
                    self.lru.pop(h, None)
                    self.pinned.add(h)
                    while self.lru and len(self.lru) + len(self.pinned) > self.cap:
                        self.lru.pop(next(iter(self.lru)))
                else:
                    self.put(h)

    def in_flight(self, h: str, now: float) -> bool:
        self.settle(now)
        return h in self.arrive

    def in_dram(self, h: str, now: float) -> bool:
        self.settle(now)
        return h in self.lru or h in self.pinned

    def prefetch(self, hashes: tuple[str, ...], now: float, pin: bool = False) -> None:
        start = max(now, self.disk_free_at)
        for i, h in enumerate(hashes):
            land = start + (i + 1) * self.disk_s
            self.arrive[h] = land
            heapq.heappush(self._landing, (land, h))
        if pin:
            self._pin_wanted.update(hashes)
        self.disk_free_at = start + len(hashes) * self.disk_s


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
    tiers = Tiers(dram_chunks=env.dram_chunks, disk_s=kv["disk"], pin_share=env.pin_share)
    pins: dict[str, tuple[str, ...]] = {}  # rid -> its pinned prefetched chunks
    views: dict[str, ReqView] = {}
    chunks = {x.rid: tuple(f"{x.rid}/{k}" for k in range(x.cached // CHUNK)) for x in trace}
    for x in trace:  # contexts start in DRAM or on disk
        if not x.on_disk:
            for h in chunks[x.rid][-8:]:
                tiers.put(h)
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
            disk = tuple(h for h in chunks[x.rid] if not tiers.in_dram(h, now))
            v = ReqView(x.rid, x.arrival, x.prompt, computed=x.cached, disk_chunks=disk)
            views[x.rid] = v
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
                tiers.prefetch(hashes, now, pin=env.pin_prefetch)
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
            for h in chunks[rid]:
                landed = h in pf and not tiers.in_flight(h, now)
                hit = tiers.in_dram(h, now)
                waited = False
                if not hit and env.wait_in_flight and h in pf:
                    land = tiers.arrive.get(h)
                    if land is not None:  # still on its way: wait for it, not a 2nd read
                        waited = True
                        load = max(load, land - now)
                load += kv["cpu"] if hit or waited else kv["disk"]
                if h in pf:  # used: the prefetch saved a disk read; alive: landed, not evicted
                    pf_score.add(0, used=hit or waited, landed=landed, alive=landed and hit)
                tiers.put(h)
            if rid in pins:  # restored: the pins' job is done
                tiers.unpin(pins.pop(rid))
        if env.store_new_kv:  # LMCache stores each newly computed full chunk in DRAM
            comp = {r.req_id: r.computed for r in s.running + s.waiting}
            for rid, n in d.prefill:
                for k in range(comp[rid] // CHUNK, (comp[rid] + n) // CHUNK):
                    tiers.put(f"{rid}/{k}")
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


STEP_TOKENS = 8192
# Longcap + Dynamic Chunk settings, from the sweep (``--sweep``; see docs/scheduling.md).
# ``context_cost`` and ``attention_cost`` are set from the calibration in ``main`` (c / b and
# d / b of the step-time model).
LONGCAP = {"step_tokens": STEP_TOKENS, "short_tokens": 16384, "long_cap": 0.25,
           "min_chunk": 256, "max_long_running": 1, "long_chunk_max": 2048,
           "short_step": 256, "short_order": "cost", "split_overhead": 0.25,
           "shorts_per_step": 1, "step_cost": 3072}


def cost_ratios(model: StepTimeModel) -> dict[str, float]:
    """The policy's cost options from the fitted step-time model, in new-token units: the
    context re-read per chunk (c / b: Dynamic Chunk's ``min_split``) and the attention pair
    (d / b); with ``step_cost`` and the ``cost`` short order they rank and size turns by
    their predicted seconds rather than their token counts."""
    a, b, c, d = (float(v) for v in model.coef)
    if b <= 0:
        return {"context_cost": 0.0, "attention_cost": 0.0}
    return {"context_cost": c / b, "attention_cost": d / b}


def policies(lookahead: int, longcap: dict[str, Any], robust: float = 0.5) -> dict[str, Any]:
    def shadow(**kw: Any) -> ShadowScheduler:
        return ShadowScheduler(LongcapDynamic(**longcap), lookahead=lookahead,
                               model=StepTimeModel(attention=True), **kw)

    return {
        "fcfs-nochunk": FcfsNoChunk(step_tokens=STEP_TOKENS),
        "fcfs-chunk": FcfsChunk(chunk_tokens=2048),
        "longcap-dynamic": LongcapDynamic(**longcap),
        "longcap-dynamic+shadow": shadow(),
        # the look-ahead expecting arrivals (``ShadowScheduler(arrivals=True)``)
        "longcap-dynamic+shadow-arrivals": shadow(arrivals=True),
        # the N+1 window only where no likely newcomer overtakes (``robust=``)
        "longcap-dynamic+shadow-robust": shadow(robust=robust),
        # the N+1 window is a plan: newcomers wait one step rather than overtake it
        # (precision / recall are then 100% by construction; see docs/scheduling.md)
        "longcap-dynamic+shadow-commit": shadow(commit=True),
    }


# ------------------------------------------------------------------ main

def ratios(base: dict[str, float], lc: dict[str, float]) -> dict[str, float]:
    return {"p50_speedup": base["p50"] / lc["p50"], "p85_speedup": base["p85"] / lc["p85"],
            "p95_ratio": lc["p95"] / base["p95"]}


SWEEP = {"short_order": ["cost", "shortest"], "shorts_per_step": [0, 1],
         "short_step": [256, 512, 2048], "step_cost": [0, 3072],
         "split_overhead": [0.25, 0.5]}


def sweep(trace: list[Turn], model: StepTimeModel, kv: dict[str, float],
          base: dict[str, float], env: Env, seed: int, split_tail: bool,
          longcap: dict[str, Any]) -> list[dict[str, Any]]:
    """Longcap + Dynamic Chunk over the ``SWEEP`` grid against the same fcfs baseline."""
    rows = []
    for values in itertools.product(*SWEEP.values()):
        cfg = {**longcap, **dict(zip(SWEEP, values, strict=True))}
        cfg["min_chunk"] = min(cfg["min_chunk"], cfg["long_chunk_max"])
        lat = replay(LongcapDynamic(**cfg), trace, model, kv, env=env, seed=seed,
                     split_tail=split_tail)["latency_s"]
        rows.append({"config": cfg, "latency_s": lat, **ratios(base, lat)})
    return rows


def planner_speed(trace: list[Turn], model: StepTimeModel, kv: dict[str, float], env: Env,
                  seed: int, split_tail: bool, longcap: dict[str, Any]) -> dict[str, Any]:
    """Wall seconds of whole replays with the fast planner vs the straightforward reference
    one (``prefill/tests/reference_planner.py``), and whether every latency came out the same
    (the same decisions at every step). A small KV pod (64k tokens) makes the safety and
    timeline checks work instead of taking their "everything fits" shortcut."""
    from agentserving.prefill.policies import fcfs
    from agentserving.prefill.tests.reference_planner import RefPlanner

    out: dict[str, Any] = {}
    for name, make in (("fcfs-chunk", lambda: FcfsChunk(chunk_tokens=2048)),
                       ("longcap-dynamic", lambda: LongcapDynamic(**longcap))):
        runs = {}
        for which in ("fast", "reference"):
            saved = fcfs.Planner
            if which == "reference":
                fcfs.Planner = RefPlanner
            try:
                t = time.perf_counter()
                r = replay(make(), trace, model, kv, env=env, seed=seed, split_tail=split_tail,
                           kv_capacity_tokens=64 * 1024)
                runs[which] = (time.perf_counter() - t, r["latency_s"], r["steps"])
            finally:
                fcfs.Planner = saved
        out[name] = {"fast_s": runs["fast"][0], "reference_s": runs["reference"][0],
                     "speedup": runs["reference"][0] / runs["fast"][0],
                     "steps": runs["fast"][2],
                     "same_results": runs["fast"][1:] == runs["reference"][1:]}
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    if args.calibration:
        cal = json.loads(args.calibration.read_text())["calibration"]
    else:
        cal = calibrate(args.quick)
    c = cal["coef"]
    model = StepTimeModel(attention=True)
    model.coef = np.array([c["a_s"], c["b_s_per_new_token"], c["c_s_per_context_token"],
                           c["d_s_per_attention_pair"]])
    kv = cal["kv_load_s_per_chunk"]
    env = Env(noise=args.noise, stall_prob=args.stall_prob, stall_factor=args.stall_factor,
              per_seq_s=args.per_seq_s, dram_chunks=args.dram_chunks, store_new_kv=True,
              pin_prefetch=args.pin, wait_in_flight=args.wait_in_flight)
    base_trace = make_trace(args.requests, 1.0, args.seed)
    rate = args.load / service_estimate(base_trace, model, env, args.split_tail)
    trace = make_trace(args.requests, rate, args.seed)
    # the context re-read per chunk in new-token units (c / b): Dynamic Chunk's min_split
    longcap = {**LONGCAP, **cost_ratios(model)}
    results = {}
    for name, pol in policies(args.lookahead, longcap, args.robust).items():
        sh = pol if isinstance(pol, ShadowScheduler) else None
        if sh is not None:  # the shadow starts from the calibration, then fits online
            sh.model.coef = model.coef.copy()
        results[name] = replay(pol, trace, model, kv, shadow=sh, env=env,
                               seed=args.seed, split_tail=args.split_tail)
    b, lc = results["fcfs-nochunk"]["latency_s"], results["longcap-dynamic"]["latency_s"]
    out = {
        "issue": 4, "quick": args.quick,
        "measured_on_real_engine": ["calibration rows and the fitted step-time model",
                                    "kv load seconds per chunk from DRAM and disk"],
        "simulated": ["arrival trace replay per policy (real policy + ShadowScheduler objects,"
                      " step times from the fitted model times seeded lognormal noise)",
                      "DRAM/disk tier residency", "the turn mix (TURN_MIX, see "
                      "docs/scheduling.md)"],
        "calibration": cal,
        "trace": {"requests": args.requests, "rate_per_s": rate, "offered_load": args.load,
                  "mean_turn_work_s": service_estimate(trace, model, env, args.split_tail),
                  "step_noise_sigma": args.noise, "seed": args.seed,
                  "env": dataclasses.asdict(env),
                  "executor_split_tail": args.split_tail,
                  **trace_summary(trace, longcap["short_tokens"])},
        "longcap_config": longcap,
        "policies": results,
        "longcap_vs_fcfs_nochunk": ratios(b, lc),
        "ratios_vs_fcfs_nochunk": {k: ratios(b, v["latency_s"]) for k, v in results.items()
                                   if k != "fcfs-nochunk"},
        "seed_003": {"p50_speedup": 12.5, "p85_speedup": 11.1, "p95_ratio": 116.6 / 92.9,
                     **{f"n1_{k}": SEED_003_N1[k] for k in ("accuracy", "precision", "recall")},
                     "prefetch_consumption": SEED_003_N1["consumption_precision"],
                     "prefetch_survival": SEED_003_N1["survival"]},
    }
    out["planner_speed"] = planner_speed(trace[: min(len(trace), 600)], model, kv, env,
                                         args.seed, args.split_tail, longcap)
    if args.sweep:
        out["sweep"] = sweep(trace, model, kv, b, env, args.seed, args.split_tail, longcap)
    out["wall_s"] = time.perf_counter() - t0
    write_result(args.out, out)
    print(json.dumps({"longcap_vs_fcfs_nochunk": out["longcap_vs_fcfs_nochunk"],
                      "utilization_fcfs": results["fcfs-nochunk"]["utilization"],
                      **{k: v["latency_s"] for k, v in results.items()},
                      **{name: {k: results[name].get(k) for k in
                                ("n_plus_1_prediction", "prefetch", "exposed_kv_s",
                                 "forward_s")}
                         for name in results if "+shadow" in name},
                      "planner_speed": out["planner_speed"]}, indent=1))
    if args.sweep:
        for r in sorted(out["sweep"], key=lambda r: -min(r["p50_speedup"], r["p85_speedup"])):
            cfg = r["config"]
            print(f"{cfg['short_order']:8s} per_step={cfg['shorts_per_step']} "
                  f"step={cfg['short_step']:4d} step_cost={cfg['step_cost']:4.0f} "
                  f"split_overhead={cfg['split_overhead']:.2f}  "
                  f"p50 x{r['p50_speedup']:.2f} p85 x{r['p85_speedup']:.2f} "
                  f"p95 {r['p95_ratio']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
