"""The real fleet at rising concurrency: how many agents it sustains, and the knee where
latency rises.

    python -m bench concurrency [--quick] [--levels 1,2,4,8,16] [--step-s 60] [--out PATH]

The fleet (``replay.fleet``): the kvindex on a real Redis, one prefill and two decode workers
on the reference engine (the tiny model, DRAM and disk KV tiers), the proxy, on this machine's
cores. At each level, that many agents (``bench.agent_load``) run sessions back to back for
``--step-s`` seconds: a ~1k-token first turn (P/D), short appends (on the session's decode
pod), the last turn closing the session. Per level: turns answered per second and end-to-end
P50/P95 of the turns that finished inside the step.

The knee is the last level before the one where throughput grows by less than
``--min-gain`` while P95 grows by more than ``--max-p95-rise``: past it, more agents only
queue. Writes the JSON and a PNG of throughput and latency against agents.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from agentserving.replay.fleet.supervisor import Fleet
from agentserving.replay.fleet.topology import FleetSpec, build
from bench.agent_load import AgentLoad, add_workload_args
from bench.common import add_run_args, percentile, progress, write_result
from testkit.servers import redis_server


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench concurrency", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="1,2,4,8,16",
                        help="Agent counts to run, comma-separated, rising.")
    parser.add_argument("--step-s", type=float, default=60.0, help="Seconds per level.")
    add_workload_args(parser)
    parser.add_argument("--min-gain", type=float, default=0.10,
                        help="Throughput gain below which a level adds nothing (0.10: 10 %%).")
    parser.add_argument("--max-p95-rise", type=float, default=0.25,
                        help="P95 rise above which a level only queues (0.25: 25 %%).")
    add_run_args(parser, "1,2 agents, 8 s", Path("bench/results/concurrency.json"), plot=True)
    args = parser.parse_args(argv)
    if args.quick:
        args.levels, args.step_s = "1,2", 8.0
    args.levels = [int(v) for v in str(args.levels).split(",")]
    if args.levels != sorted(set(args.levels)) or args.levels[0] < 1:
        parser.error("--levels: distinct positive agent counts, rising")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, redis_server() as redis:
        work = Path(tmp)
        spec = FleetSpec(prefill=1, decode=2, kvindex=redis.url, engine="reference",
                         model="tiny", cpu_cache_gib=0.5, disk_cache_gib=1.0,
                         disk_cache_root=work / "disk", worker_args=["--torch-threads", "1"],
                         startup_timeout_s=180.0)
        with Fleet(build(spec, work), work, log_dir=work / "logs") as fleet, \
                progress(not args.no_progress) as bar:
            task = bar.add_task("concurrency: levels", total=len(args.levels))
            for agents in args.levels:
                rows.append(run_level(fleet.url("proxy") or "", agents, args))
                bar.advance(task)
    result = {"levels": rows, "knee": knee(rows, args),
              "config": {"step_s": args.step_s, "turns_per_session": args.turns,
                         "first_tokens": args.first_tokens,
                         "append_tokens": args.append_tokens, "prefill": 1, "decode": 2,
                         "engine": "reference", "model": "tiny"}}
    plot(rows, result["knee"], args.out.with_suffix(".png"))
    for r in rows:
        print(f"agents {r['agents']:>3}: {r['turns_per_s']:6.2f} turns/s  E2E P50 "
              f"{r['p50_ms']:8.1f} ms  P95 {r['p95_ms']:8.1f} ms  failed {r['failed']}")
    print(f"knee: {result['knee']['agents']} agents ({result['knee']['why']})")
    write_result(args.out, result)
    return 0


def run_level(proxy: str, agents: int, args: argparse.Namespace) -> dict[str, Any]:
    load = AgentLoad.from_args(proxy, agents, args)
    start = time.perf_counter()
    load.start()
    time.sleep(args.step_s)
    end = time.perf_counter()
    load.join()
    inside = [ms for done, ms in load.answered if done <= end]
    return {"agents": agents, "turns": len(inside), "turns_per_s": len(inside) / (end - start),
            "p50_ms": statistics.median(inside) if inside else None,
            "p95_ms": percentile(inside, 0.95) if inside else None,
            "failed": load.failed, "errors": load.errors, "sessions_closed": load.sessions}


def knee(rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """The last level before more agents stop adding throughput and only add latency."""
    for prev, cur in zip(rows, rows[1:], strict=False):
        if not (prev["turns"] and cur["turns"]):
            continue
        gain = cur["turns_per_s"] / prev["turns_per_s"] - 1
        rise = cur["p95_ms"] / prev["p95_ms"] - 1
        if gain < args.min_gain and rise > args.max_p95_rise:
            return {"agents": prev["agents"], "reached": True,
                    "why": f"at {cur['agents']} agents throughput {gain:+.0%}, P95 {rise:+.0%}"}
    return {"agents": rows[-1]["agents"], "reached": False,
            "why": "throughput still grew at the highest level run"}


def plot(rows: list[dict[str, Any]], found: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    agents = [r["agents"] for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    top.plot(agents, [r["turns_per_s"] for r in rows], marker="o")
    top.set_ylabel("turns answered / s")
    bottom.plot(agents, [r["p50_ms"] for r in rows], marker="o", label="E2E P50")
    bottom.plot(agents, [r["p95_ms"] for r in rows], marker="o", label="E2E P95")
    bottom.set_ylabel("ms")
    bottom.set_xlabel("concurrent agents")
    bottom.legend()
    for ax in (top, bottom):
        ax.set_xscale("log", base=2)
        ax.axvline(found["agents"], color="grey", linestyle="--", alpha=0.6)
        ax.grid(alpha=0.3)
    top.set_title(f"knee: {found['agents']} agents" + ("" if found["reached"]
                                                        else " (not reached)"))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
