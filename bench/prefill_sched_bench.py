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
   chunk split) and a DRAM/disk tier model with the measured per-chunk load costs.
3. NOT YET IMPLEMENTED: a small real-engine run for exposed KV time. The exposed-KV numbers
   in the JSON are simulated, and count all admission load time as exposed (the engine
   has no layer-wise overlap yet).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from agentserving.prefill.policies import (
    FcfsChunk,
    FcfsNoChunk,
    LongcapDynamic,
    ReqView,
    SchedState,
    advance,
)
from agentserving.prefill.shadow import ShadowScheduler, StepTimeModel
from bench.common import write_result

CHUNK = 256


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench prefill_sched", description=__doc__)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--load", type=float, default=0.95, help="Offered load vs fcfs capacity.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lookahead", type=int, default=5)
    p.add_argument("--noise", type=float, default=0.1,
                   help="Sigma of the mean-one lognormal factor on simulated step times.")
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


def turn_work(x: Turn, model: StepTimeModel) -> float:
    """Seconds of compute one turn needs, its step overhead ``a`` included (an upper bound:
    fcfs batches short turns, sharing ``a``)."""
    new = x.prompt - x.cached
    return model.predict(new, x.cached, StepTimeModel.chunk_pairs(new, x.cached))


def service_estimate(trace: list[Turn], model: StepTimeModel) -> float:
    return float(np.mean([turn_work(x, model) for x in trace]))


def trace_summary(trace: list[Turn], short_tokens: int) -> dict[str, Any]:
    new = np.array([x.prompt - x.cached for x in trace])
    return {"turns_by_kind": {k: sum(x.kind == k for x in trace) for k in TURN_MIX},
            "new_tokens": {"p50": pct(list(new), 50), "p90": pct(list(new), 90),
                           "p99": pct(list(new), 99), "max": int(new.max())},
            "cached_tokens_p50": pct([x.cached for x in trace], 50),
            "long_share": float(np.mean(new > short_tokens)),
            "short_tokens": short_tokens}


class Tiers:
    """DRAM (LRU, in chunks) over disk; a single disk queue serves prefetches."""

    def __init__(self, dram_chunks: int, disk_s: float) -> None:
        self.cap = dram_chunks
        self.lru: dict[str, None] = {}
        self.disk_s = disk_s
        self.disk_free_at = 0.0
        self.arrive: dict[str, float] = {}  # chunk -> time its prefetch lands in DRAM

    def put(self, h: str) -> None:
        self.lru.pop(h, None)
        self.lru[h] = None
        while len(self.lru) > self.cap:
            self.lru.pop(next(iter(self.lru)))

    def in_dram(self, h: str, now: float) -> bool:
        land = self.arrive.get(h)
        if land is not None and land <= now:
            del self.arrive[h]
            self.put(h)
        return h in self.lru

    def prefetch(self, hashes: tuple[str, ...], now: float) -> None:
        start = max(now, self.disk_free_at)
        for i, h in enumerate(hashes):
            self.arrive[h] = start + (i + 1) * self.disk_s
        self.disk_free_at = start + len(hashes) * self.disk_s


def replay(policy: Any, trace: list[Turn], model: StepTimeModel, kv: dict[str, float],
           shadow: ShadowScheduler | None = None, noise: float = 0.0,
           seed: int = 0, split_tail: bool = True) -> dict[str, Any]:
    """Replay ``trace`` on one pod. A step's forward time is the fitted model's times a
    seeded mean-one lognormal factor (sigma ``noise``): the shadow predicts from its own
    model, fitted online from those noisy measured steps, as in the engine."""
    noise_rng = np.random.default_rng(seed)
    tiers = Tiers(dram_chunks=1500, disk_s=kv["disk"])
    views: dict[str, ReqView] = {}
    chunks = {x.rid: tuple(f"{x.rid}/{k}" for k in range(x.cached // CHUNK)) for x in trace}
    for x in trace:  # contexts start in DRAM or on disk
        if not x.on_disk:
            for h in chunks[x.rid][-8:]:
                tiers.put(h)
    s = SchedState((), (), max_running=32, kv_capacity_tokens=512 * 1024, block_size=CHUNK,
                   quantum=CHUNK, split_tail=split_tail)
    now, i, done = 0.0, 0, {}
    arrival = {x.rid: x.arrival for x in trace}
    forward, exposed, pending_pred = [], [], None
    pred_log: dict[str, list[tuple[int, Any]]] = {}  # rid -> (step made, Prediction)
    horizon: dict[int, list[int]] = {}                # offset -> [exact, predictions]
    made_at: dict[int, float] = {}
    eta_err: list[float] = []
    conf = {"tp": 0, "fp": 0, "fn": 0, "tn": 0, "fn_new_arrivals": 0}
    pf_chunks = pf_used = pf_alive = pf_admitted_chunks = 0
    prefetched: dict[str, tuple[str, ...]] = {}
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
                pred, waiting_then = pending_pred
                actual = set(d.admit)
                for rid in waiting_then:
                    p, a = rid in pred, rid in actual
                    conf["tp" if p and a else "fp" if p else "fn" if a else "tn"] += 1
                conf["fn_new_arrivals"] += len(actual - set(waiting_then))
            pending_pred = ({r for r, pr in res.predictions.items() if pr.offset == 1},
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
                tiers.prefetch(hashes, now)
                prefetched[rid] = hashes
                pf_chunks += len(hashes)
        else:
            d = policy.decide(s)
        fwd = model.predict_step(d, s)
        if noise > 0:
            fwd *= float(noise_rng.lognormal(-noise * noise / 2, noise))
        if shadow is not None:
            shadow.observe_step(d, s, fwd)
        load = 0.0
        for rid in d.admit:
            for h in chunks[rid]:
                hit = tiers.in_dram(h, now)
                load += kv["cpu"] if hit else kv["disk"]
                if rid in prefetched and h in prefetched[rid]:
                    pf_admitted_chunks += 1
                    pf_alive += hit
                    pf_used += hit
                tiers.put(h)
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
    if shadow is not None:
        tp, fp, fn, tn = conf["tp"], conf["fp"], conf["fn"], conf["tn"]
        out["n_plus_1_prediction"] = {
            **conf, "accuracy": (tp + tn) / max(1, tp + fp + fn + tn),
            "precision": tp / max(1, tp + fp), "recall": tp / max(1, tp + fn),
            "recall_incl_new_arrivals": tp / max(1, tp + fn + conf["fn_new_arrivals"]),
            # every N+k prediction (k = 1..lookahead): admitted at exactly step N+k?
            "exact_step_by_offset": {k: v[0] / v[1] for k, v in sorted(horizon.items())},
            "predictions_by_offset": {k: v[1] for k, v in sorted(horizon.items())},
            # predicted minus actual seconds until an N+1-predicted admission (the shadow's
            # online-fitted model vs the noisy simulated steps)
            "n1_eta_error_s": {"p50_abs": pct([abs(e) for e in eta_err], 50),
                               "p95_abs": pct([abs(e) for e in eta_err], 95),
                               "mean": float(np.mean(eta_err)) if eta_err else float("nan")}}
        out["prefetch"] = {"chunks": pf_chunks,
                           "consumption_precision": pf_used / max(1, pf_chunks),
                           "survival": pf_alive / max(1, pf_admitted_chunks)}
    return out


STEP_TOKENS = 8192
# Longcap + Dynamic Chunk settings, from the sweep (``--sweep``; see docs/scheduling.md).
LONGCAP = {"step_tokens": STEP_TOKENS, "short_tokens": 4096, "long_cap": 0.25,
           "min_chunk": 512, "max_long_running": 1, "long_chunk_max": 512}


def policies(lookahead: int, longcap: dict[str, Any]) -> dict[str, Any]:
    return {
        "fcfs-nochunk": FcfsNoChunk(step_tokens=STEP_TOKENS),
        "fcfs-chunk": FcfsChunk(chunk_tokens=2048),
        "longcap-dynamic": LongcapDynamic(**longcap),
        "longcap-dynamic+shadow": ShadowScheduler(LongcapDynamic(**longcap),
                                                  lookahead=lookahead,
                                                  model=StepTimeModel(attention=True)),
    }


# ------------------------------------------------------------------ main

def ratios(base: dict[str, float], lc: dict[str, float]) -> dict[str, float]:
    return {"p50_speedup": base["p50"] / lc["p50"], "p85_speedup": base["p85"] / lc["p85"],
            "p95_ratio": lc["p95"] / base["p95"]}


SWEEP = {"short_tokens": [1024, 2048, 4096], "long_cap": [0.125, 0.25, 0.5],
         "max_long_running": [1, 2], "long_chunk_max": [256, 512, 1024, 2048, 8192]}


def sweep(trace: list[Turn], model: StepTimeModel, kv: dict[str, float],
          base: dict[str, float], noise: float, seed: int,
          split_tail: bool) -> list[dict[str, Any]]:
    """Longcap + Dynamic Chunk over the ``SWEEP`` grid against the same fcfs baseline."""
    rows = []
    for short, cap, mlr, lcm in itertools.product(*SWEEP.values()):
        cfg = {**LONGCAP, "short_tokens": short, "long_cap": cap, "max_long_running": mlr,
               "long_chunk_max": lcm, "min_chunk": min(LONGCAP["min_chunk"], lcm)}
        lat = replay(LongcapDynamic(**cfg), trace, model, kv, noise=noise, seed=seed,
                     split_tail=split_tail)["latency_s"]
        rows.append({"config": cfg, "latency_s": lat, **ratios(base, lat)})
    return rows


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
    base_trace = make_trace(args.requests, 1.0, args.seed)
    rate = args.load / service_estimate(base_trace, model)
    trace = make_trace(args.requests, rate, args.seed)
    results = {}
    for name, pol in policies(args.lookahead, LONGCAP).items():
        sh = pol if isinstance(pol, ShadowScheduler) else None
        if sh is not None:  # the shadow starts from the calibration, then fits online
            sh.model.coef = model.coef.copy()
        results[name] = replay(pol, trace, model, kv, shadow=sh, noise=args.noise,
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
                  "mean_turn_work_s": service_estimate(trace, model),
                  "step_noise_sigma": args.noise, "seed": args.seed,
                  "executor_split_tail": args.split_tail,
                  **trace_summary(trace, LONGCAP["short_tokens"])},
        "longcap_config": LONGCAP,
        "policies": results,
        "longcap_vs_fcfs_nochunk": ratios(b, lc),
        "seed_003": {"p50_speedup": 12.5, "p85_speedup": 11.1, "p95_ratio": 116.6 / 92.9,
                     "n1_accuracy": 0.9588, "n1_precision": 0.9124, "n1_recall": 0.9307,
                     "prefetch_consumption": 0.9919, "prefetch_survival": 0.9950},
    }
    if args.sweep:
        out["sweep"] = sweep(trace, model, kv, b, args.noise, args.seed, args.split_tail)
    out["wall_s"] = time.perf_counter() - t0
    write_result(args.out, out)
    print(json.dumps({"longcap_vs_fcfs_nochunk": out["longcap_vs_fcfs_nochunk"],
                      "utilization_fcfs": results["fcfs-nochunk"]["utilization"],
                      **{k: v["latency_s"] for k, v in results.items()},
                      "shadow": {k: results["longcap-dynamic+shadow"].get(k) for k in
                                 ("n_plus_1_prediction", "prefetch", "exposed_kv_s",
                                  "forward_s")}}, indent=1))
    if args.sweep:
        for r in sorted(out["sweep"], key=lambda r: -min(r["p50_speedup"], r["p85_speedup"])):
            cfg = r["config"]
            print(f"short={cfg['short_tokens']:5d} cap={cfg['long_cap']:.3f} "
                  f"mlr={cfg['max_long_running']} lcm={cfg['long_chunk_max']:4d}  "
                  f"p50 x{r['p50_speedup']:.2f} p85 x{r['p85_speedup']:.2f} "
                  f"p95 {r['p95_ratio']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
