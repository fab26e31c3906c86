"""The cluster simulator: validation vs a real bench run, seed 003's table in shape,
and scale.

    python -m bench sim [--quick] [--real RUN/report.json] [--out bench/results/sim.json]

1. validation: the real run's workload and fleet (its topology and rate, every worker's own
   FCFS scheduler) on the calibrated ``reference-cpu`` profile, vs a real ``agentserving
   bench`` report.json (``--real``, repeatable, else the newest runs/*/report.json), with the
   host's load measured from the run's engine metrics (``sim/validate.py``); errors on
   request throughput and E2E P95 (target: within 15%).
2. seed 003 in shape: the ``agent`` preset at 1,999 sessions, Poisson 5 IPS, 1P3D vs 4
   independent pods, on ``910b3-qwen3-4b`` and ``910b3-llama8b``; the simulator's ratios beside
   the seed's. (--quick: 300 sessions.)
3. scale: xPyD clusters of growing size (up to 64 pods, 100k sessions at full size) with the
   kvindex lookup load and routing quality per pod count; wall time of each run.
Everything here is simulated except the real run read in part 1.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import add_out_args, write_result

SEED_003 = {"910b3-qwen3-4b": {"req_per_s": 2.075 / 1.213, "prefix_hit_rate": 0.9285,
                               "e2e_p95_s": 94.18 / 275.90, "itl_p99_s": 0.127 / 1.923},
            "910b3-llama8b": {"req_per_s": 2.208 / 1.073, "prefix_hit_rate": 0.9291,
                              "e2e_p95_s": 93.69 / 278.76, "itl_p99_s": 0.103 / 1.356}}
KEYS = ("req_per_s", "tok_per_s", "prefix_hit_rate", "e2e_p95_s", "e2e_p99_s", "ttft_p50_s",
        "itl_p99_s", "turns_completed", "success_rate")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench sim", description=__doc__)
    add_out_args(p, Path("bench/results/sim.json"))
    p.add_argument("--real", type=Path, action="append", default=None,
                   help="a real bench report.json (repeatable); default: the newest runs/*")
    p.add_argument("--parts", default="1,2,3")
    p.add_argument("--scale", default=None,
                   help="part 3's points as PODS:SESSIONS,... (default 4:1000,16:4000 with "
                        "--quick, else those and 64:100000)")
    p.add_argument("--per-pod", type=float, default=0.4,
                   help="part 3's offered load, root sessions/s per pod (default 0.4: what the "
                        "64-pod cluster carries for a whole 100k-session run; at 0.5 its "
                        "queues grow once the KV tiers fill, see docs/sim.md)")
    return p.parse_args(argv)


def pair(trace: Any, profile: str, topology: str, rate: float | None,
         names: tuple[str, ...] = ("baseline", "agentserving"), **kw: Any) -> dict:
    from agentserving.sim import SimConfig, load_profile, simulate
    from agentserving.sim.workload import compile_trace

    prof = load_profile(profile)
    out = {}
    for name in names:
        t0 = time.perf_counter()
        r = simulate(compile_trace(trace), prof,
                     SimConfig(config=name, topology=topology, rate=rate, **kw))
        out[name] = {**{k: r.summary.get(k) for k in KEYS}, "wall_s": time.perf_counter() - t0,
                     "sim": r.summary["sim"]}
    return out


def validation(real: Path | None, profile: str = "reference-cpu") -> dict[str, Any]:
    from agentserving.replay.loader import load_trace
    from agentserving.sim import load_profile
    from agentserving.sim.validate import validate
    from agentserving.sim.workload import compile_trace

    if real is None:
        found = sorted(Path("runs").glob("*/report.json"))
        if not found:
            return {"skipped": "no real bench report.json (pass --real)"}
        real = found[-1]
    rep = json.loads(real.read_text())
    trace = load_trace(rep.get("workload", {}).get("spec", "bundled:bench-small"))
    t0 = time.perf_counter()
    out = validate(rep, compile_trace(trace), load_profile(profile))
    out["real_report"] = str(real)
    out["wall_s"] = time.perf_counter() - t0
    return out


def _ratios(agent: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """Seed 003's columns: agentserving over the baseline, and agentserving's prefix hit."""
    out = {k: (agent[k] / base[k] if base[k] else None)
           for k in ("req_per_s", "e2e_p95_s", "itl_p99_s")}
    out["prefix_hit_rate"] = agent["prefix_hit_rate"]
    return out


def seed_table(quick: bool) -> dict[str, Any]:
    from agentserving.proxy.settings import ProxySettings
    from agentserving.replay.synthetic import generate_preset

    n = 300 if quick else 1999
    trace = generate_preset("agent", sessions=n)
    out = {}
    for prof, seed in SEED_003.items():
        res = pair(trace, prof, "1P3D", 5.0)
        b, a = res["baseline"], res["agentserving"]
        ratios = _ratios(a, b)
        # the same 1P3D with the proxy's default conditional disaggregation (seed 003's 1P3D
        # sent every turn through P/D): short appends prefill on their decode pods
        local = pair(trace, prof, "1P3D", 5.0, names=("agentserving",),
                     local_prefill_tokens=ProxySettings().local_prefill_tokens)["agentserving"]
        local_ratios = _ratios(local, b)
        out[prof] = {"sessions": n, "ips": 5.0, "sim": res, "sim_ratios": ratios,
                     "seed_ratios": seed, "conditional_disaggregation": {
                         "sim": local, "sim_ratios": local_ratios}}
        print(json.dumps({prof: {"sim": ratios, "seed": seed,
                                 "conditional_disaggregation": local_ratios}}), flush=True)
    return out


def scale(quick: bool, points: str | None = None, per_pod: float = 0.4) -> dict[str, Any]:
    from agentserving.replay.synthetic import generate_preset
    from agentserving.sim import SimConfig, load_profile, simulate
    from agentserving.sim.workload import compile_trace

    prof = load_profile("h200-llama8b")
    plan = [(4, 1000), (16, 4000)] if quick else [(4, 1000), (16, 4000), (64, 100_000)]
    if points:
        plan = [(int(a), int(b)) for a, b in (x.split(":") for x in points.split(","))]
    rows = []
    for pods, sessions in plan:
        t0, c0 = time.perf_counter(), time.process_time()
        trace = generate_preset("agent", sessions=sessions)
        ss = compile_trace(trace)
        gen_s, gen_cpu_s = time.perf_counter() - t0, time.process_time() - c0
        topo = f"{pods // 4}P{pods - pods // 4}D"
        ips = per_pod * pods  # offered load grows with the cluster
        cpu0 = time.process_time()
        r = simulate(ss, prof, SimConfig(topology=topo, rate=ips))
        cpu_s = time.process_time() - cpu0   # what the run costs when the cores are shared
        st = r.summary["sim"]
        queued = r.timeseries.get("queued_turns", [])
        quarters = [queued[len(queued) * i // 4: len(queued) * (i + 1) // 4] for i in range(4)]
        rows.append({"pods": pods, "topology": topo, "sessions": sessions, "ips": ips,
                     "turns": r.summary["turns_completed"], "wall_s": st["wall_s"],
                     "cpu_s": cpu_s, "workload_cpu_s": gen_cpu_s,
                     "total_cpu_s": cpu_s + gen_cpu_s, "total_wall_s": time.perf_counter() - t0,
                     "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                     "sessions_per_wall_s": sessions / st["wall_s"],
                     "projected_100k_s": 100_000 / (sessions / st["wall_s"]),
                     "workload_s": gen_s, "events": st["events"],
                     "lookups": st["lookups"], "lookup_chunks_mean":
                         st["lookup_chunks"] / max(1, st["lookups"]),
                     "lookup_us_mean": 1e6 * st["lookup_s"] / max(1, st["lookups"]),
                     "lookups_per_sim_s": st["lookups"] / r.summary["makespan_s"]
                     if r.summary.get("makespan_s") else None,
                     "event_batches": st["event_batches"], "chunk_events": st["chunk_events"],
                     "index_chunk_ops": st.get("index_chunk_ops"),
                     "index_apply_s": st["index_apply_s"],
                     "route_prefix_efficiency": st["route_prefix_efficiency"],
                     "hit_vs_ideal": r.summary["hit_vs_ideal"],
                     "req_per_s": r.summary["req_per_s"], "e2e_p95_s": r.summary["e2e_p95_s"],
                     "e2e_p50_s": r.summary.get("e2e_p50_s"),
                     "prefix_hit_rate": r.summary["prefix_hit_rate"],
                     "makespan_s": r.summary.get("makespan_s"),
                     # turns waiting for a prefill or decode slot, mean per quarter of the
                     # run: a cluster that carries the load keeps these flat
                     "queued_turns_by_quarter": [round(sum(q) / len(q), 1) if q else None
                                                 for q in quarters],
                     "queued_turns_max": max(queued, default=None)})
        print(json.dumps(rows[-1]), flush=True)
    return {"profile": prof.name, "per_pod_ips": per_pod, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    parts = {p.strip() for p in args.parts.split(",")}
    t0 = time.perf_counter()
    out: dict[str, Any] = {"quick": args.quick,
                           "simulated": "everything except the real run read in validation"}
    if "1" in parts:
        out["validation"] = [validation(r) for r in (args.real or [None])]
        for v in out["validation"]:
            brief = {name: {"environment": row["environment"], **{
                k: row["fitted"][k]["error"] for k in ("req_per_s", "e2e_p95_s")}}
                for name, row in v.get("configs", {}).items()}
            print(json.dumps({"validation": v.get("real_report"), "errors": brief,
                              "within_15pct": v.get("within_15pct")}), flush=True)
        if len(out["validation"]) > 1:
            from agentserving.sim.validate import across_runs

            out["validation_across_runs"] = across_runs(out["validation"])
            print(json.dumps({"across_runs": out["validation_across_runs"]}), flush=True)
    if "2" in parts:
        out["seed_003"] = seed_table(args.quick)
    if "3" in parts:
        out["scale"] = scale(args.quick, args.scale, args.per_pod)
    out["wall_s"] = time.perf_counter() - t0
    write_result(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
