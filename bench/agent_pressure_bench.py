"""agentserving against the stack users would deploy, where agents strain memory.

    python -m bench agent_pressure [--quick] [--repeats N] [--configs A,B] [--limit N]

``agentserving compare`` on vLLM pods with the bundled ``agent-pressure`` workload (48 real
SWE-bench agent sessions arriving together, agentic and human pauses, context resets,
forked subagents; its header in replay/workloads/agent-pressure.jsonl), the configurations
interleaved over ``--repeats`` runs: agentserving, llmd (llm-d's tiered prefix cache),
vllm-precise, and agentserving with TTL pins through tool calls or without its prefetch.
Each pod's DRAM tier is the workload's ``fleet_dram_gib_at_most`` over the pods, so the
sessions' working set is at least three times the fleet's DRAM and KV leaves DRAM during
human pauses.

Writes ``bench/results/agent_pressure.json``: per configuration the median of the repeats
(``configs.<name>.median``) with ``min`` and ``max`` of ``mean_jct_s``,
``ttft_p50_after_human_pause_s``, ``e2e_p95_s``, ``branch_start_ttft_p90_s``,
``failed_turns``, ``forced_mismatches``, ``disk_read_critical_s`` (the disk reads on the
turns' critical path, from each turn's ``prompt_sources``), and the target ratios of
agentserving against llmd and its variants, judged on medians; and a PNG beside it: TTFT
against the pause before the turn, one line per configuration. ``--quick``: agentserving
and llmd, one repeat, the first 6 tasks (with their subagents).
"""

from __future__ import annotations

import argparse
import functools
import json
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.common import add_run_args, fleet_work_dir, save_figure, write_result

OUT = Path("bench/results/agent_pressure.json")
WORKLOAD = "bundled:agent-pressure"
CONFIGS = ("agentserving", "llmd", "vllm-precise", "agentserving-toolpin",
           "agentserving-noprefetch")
QUICK_CONFIGS = ("agentserving", "llmd")
QUICK_LIMIT = 6
PODS = 3  # compare's default fleet: 1 prefill + 2 decode pods (llmd: 3 that do both)
# the replay summary's figures the bench reports, by the names its JSON gives them
FIGURES = {"mean_jct_s": "mean_jct_s",
           "ttft_p50_after_human_pause_s": "ttft_p50_after_human_pause_s",
           "e2e_p95_s": "e2e_p95_s", "branch_start_ttft_p90_s": "branch_start_ttft_p90_s",
           "failed_turns": "turns_failed", "forced_mismatches": "forced_mismatches",
           "req_per_s": "req_per_s", "hit_vs_ideal": "hit_vs_ideal",
           # the disk-tier reads on the turns' critical path, as their pods measured them,
           # summed over the turns that read from disk when they ran (replay.metrics)
           "disk_read_critical_s": "disk_read_critical_s", "disk_read_turns": "disk_read_turns",
           "kv_load_s": "kv_load_s", "sourced_turns": "sourced_turns"}
# the targets: (figure, candidate, against, bound): candidate / against <= bound for
# "lower is better" figures (a bound > 1 means: at least that many times better)
TARGETS = (("mean_jct_s", "agentserving", "llmd", 0.67),
           ("ttft_p50_after_human_pause_s", "agentserving", "llmd", 0.5),
           ("e2e_p95_s", "agentserving", "llmd", 0.7),
           ("branch_start_ttft_p90_s", "agentserving", "llmd", 0.5),
           # the prefetch would have to take 80 % of the disk reads off the critical path
           ("disk_read_critical_s", "agentserving", "agentserving-noprefetch", 0.2),
           # TTL pins (off in agentserving) would have to make sessions 1.2x faster
           ("mean_jct_s", "agentserving-toolpin", "agentserving", 1 / 1.2))
# TTFT against the pause before the turn: the pause bins of the plot, in seconds as replayed
PAUSE_EDGES = (0.0, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 80.0)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench agent_pressure",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=None,
                        help=f"Comma-separated configurations (default {','.join(CONFIGS)}; "
                        f"with --quick {','.join(QUICK_CONFIGS)}).")
    parser.add_argument("--repeats", type=int, default=None,
                        help="Interleaved runs of every configuration (default 3; 1 with "
                        "--quick).")
    parser.add_argument("--limit", type=int, default=None,
                        help=f"First N tasks, each with its subagents (default all 48; "
                        f"{QUICK_LIMIT} with --quick).")
    parser.add_argument("--run-dir", type=Path, default=None,
                        help="Where the compare run goes (default under runs/).")
    parser.add_argument("--from-run", type=Path, default=None,
                        help="Summarise an existing compare run folder instead of running one.")
    parser.add_argument("--command", default=None,
                        help="With --from-run: the compare command that made it, for the JSON.")
    parser.add_argument("--rename", action="append", default=[], metavar="RAN=NAME",
                        help="With --from-run: report the configuration the run named RAN as "
                        "NAME (a run from before a default changed, whose flags NAME now "
                        "names); repeatable, recorded in the JSON.")
    add_run_args(parser, f"{','.join(QUICK_CONFIGS)}, one repeat, {QUICK_LIMIT} tasks", OUT,
                 plot=True)
    args = parser.parse_args(argv)
    args.configs = args.configs or ",".join(QUICK_CONFIGS if args.quick else CONFIGS)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.limit = args.limit or (QUICK_LIMIT if args.quick else None)
    return args


@functools.cache
def _trace(workload: str) -> Any:
    """The workload, loaded once: the run sizes its DRAM from it and the summary reads its
    pauses."""
    from agentserving.replay.loader import load_trace

    return load_trace(workload)


def dram_per_pod_gib(workload: str = WORKLOAD, pods: int = PODS) -> float:
    """Each pod's DRAM tier: the workload header's largest fleet DRAM at most a third of its
    working set, over the pods."""
    header = _trace(workload).header.generator
    return round(header["fleet_dram_gib_at_most"] / pods, 3)


def compare_command(args: argparse.Namespace, run_dir: Path) -> list[str]:
    from agentserving.replay.testing import AGENTSERVING

    argv = [AGENTSERVING, "compare", "--engine", "vllm", "--configs", args.configs,
            "--workload", WORKLOAD, "--repeats", str(args.repeats),
            "--cpu-cache-gib", str(dram_per_pod_gib()), "--disk-io", "direct",
            "--time-scale", "1.0", "--run-dir", str(run_dir)]
    if args.limit:
        argv += ["--limit", str(args.limit)]
    if args.no_progress:
        argv.append("--no-progress")
    return argv


def repeat_dirs(run_dir: Path) -> list[Path]:
    """The folders of a compare run's repeats (the run itself when it ran once)."""
    dirs = sorted(run_dir.glob("repeat-*"), key=lambda p: int(p.name.split("-")[1]))
    return dirs or [run_dir]


def summarise(summaries: Sequence[Mapping[str, Mapping[str, Any]]]
              ) -> dict[str, dict[str, dict[str, Any]]]:
    """Per configuration (as the repeats' summaries name them): each figure's median, min and
    max over the repeats that have it (None where none has), as ``compare --repeats`` takes
    them (``replay.repeats``)."""
    from agentserving.replay.repeats import median_of, spread

    names = list(dict.fromkeys(n for rep in summaries for n in rep))
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for name in names:
        runs = [{figure: rep[name].get(key) for figure, key in FIGURES.items()}
                for rep in summaries if name in rep]
        stats = {"median": {f: median_of([r[f] for r in runs]) for f in FIGURES},
                 **spread(runs, list(FIGURES))}
        stats["repeats"] = {"n": len(runs)}
        out[name] = stats
    return out


def judge(configs: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each target whose two configurations ran: the ratio of medians and whether it holds."""
    out = []
    for figure, cand, other, bound in TARGETS:
        if cand not in configs or other not in configs:
            continue
        a, b = configs[cand]["median"].get(figure), configs[other]["median"].get(figure)
        ratio = a / b if isinstance(a, int | float) and isinstance(b, int | float) and b \
            else None
        out.append({"figure": figure, "config": cand, "against": other,
                    "ratio": None if ratio is None else round(ratio, 3),
                    "at_most": round(bound, 3), "met": ratio is not None and ratio <= bound})
    return out


def trace_pauses(workload: str = WORKLOAD) -> dict[tuple[str, int], float]:
    """(session, turn) -> the pause before that turn, as the trace has it (the bench replays
    at --time-scale 1.0): agentic and human pauses alike (a turn's record keeps only the gap
    of a tool call, and a human pause follows none)."""
    return {(s.session_id, k): s.turns[k - 1].tool_gap_s
            for s in _trace(workload).sessions for k in range(1, len(s.turns))}


def pause_curve(records: Sequence[Mapping[str, Any]], pauses: Mapping[tuple[str, int], float],
                edges: Sequence[float] = PAUSE_EDGES) -> list[dict[str, Any]]:
    """Median TTFT of the answered turns after a pause in each bin ([edge, next edge); the
    last bin open), first turns of sessions left out (no pause before them)."""
    bins: list[list[float]] = [[] for _ in edges]
    for r in records:
        key = (r.get("session_id"), r.get("turn", 0))
        if not r.get("ok") or r.get("ttft_s") is None or key not in pauses:
            continue
        pause = pauses[key]
        k = max(i for i, edge in enumerate(edges) if pause >= edge)
        bins[k].append(r["ttft_s"])
    return [{"pause_from_s": edges[k], "turns": len(v),
             "ttft_p50_s": statistics.median(v) if v else None} for k, v in enumerate(bins)]


def turn_records(run_dir: Path, config: str) -> list[dict[str, Any]]:
    out = []
    for folder in repeat_dirs(run_dir):
        path = folder / config / "turns.jsonl"
        if path.is_file():
            out += [json.loads(line) for line in path.read_text().splitlines() if line]
    return out


def plot(curves: Mapping[str, list[dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for name, curve in curves.items():
        points = [(c["pause_from_s"], c["ttft_p50_s"]) for c in curve
                  if c["ttft_p50_s"] is not None]
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=name)
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_xlabel("pause before the turn (s, lower edge of its bin)")
    ax.set_ylabel("TTFT P50 (s)")
    ax.set_title("agent-pressure on vLLM: TTFT after a pause")
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, path)


def result(run_dir: Path, command: str | None, seconds: float | None,
           renamed: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The bench's JSON from a finished compare run folder (``renamed``: the run's name of a
    configuration -> the name reported)."""
    renamed = dict(renamed or {})
    summaries = []
    for folder in repeat_dirs(run_dir):
        report = folder / "report.json"
        if report.is_file():
            ran = json.loads(report.read_text())["configs"]
            summaries.append({renamed.get(n, n): c for n, c in ran.items()})
    if not summaries:
        raise FileNotFoundError(f"no report.json under {run_dir}")
    configs = summarise(summaries)
    pauses = trace_pauses()
    if seconds is None and (run_dir / "report.json").is_file():  # the run's own duration
        seconds = json.loads((run_dir / "report.json").read_text()).get("duration_s")
    ran_as = {new: old for old, new in renamed.items()}
    return {"bench": "agent_pressure", "workload": WORKLOAD, "compare_command": command,
            "renamed": renamed, "repeats": len(summaries), "configs": configs,
            "targets": judge(configs),
            "ttft_by_pause": {n: pause_curve(turn_records(run_dir, ran_as.get(n, n)), pauses)
                              for n in configs},
            "seconds": seconds}


def renames(pairs: Sequence[str]) -> dict[str, str]:
    """``--rename RAN=NAME`` flags -> {RAN: NAME}; a malformed one names itself."""
    out = {}
    for pair in pairs:
        ran, sep, name = pair.partition("=")
        if not sep or not ran or not name:
            raise SystemExit(f"--rename {pair!r}: expected RAN=NAME")
        out[ran] = name
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from agentserving.engine.vllm.serve_command import DEFAULT_ENV_DIR

    started = time.time()
    command = args.command
    run_dir = args.from_run
    if run_dir is None:
        if not (DEFAULT_ENV_DIR / "bin" / "python").exists():
            print("agent_pressure: no vLLM environment (scripts/vllm-env.sh installs it); "
                  "skipped", file=sys.stderr)
            return 0
        run_dir = args.run_dir or fleet_work_dir("agent-pressure")
        cmd = compare_command(args, run_dir)
        command = shlex.join(["agentserving", *cmd[1:]])
        print(command, flush=True)
        done = subprocess.run(cmd)
        if done.returncode != 0:
            print(f"agent_pressure: compare exited with {done.returncode}", file=sys.stderr)
            return done.returncode
    seconds = None if args.from_run else round(time.time() - started, 1)
    out = result(run_dir, command, seconds, renames(args.rename))
    out["quick"] = args.quick
    write_result(args.out, out)
    plot({n: c for n, c in out["ttft_by_pause"].items()}, args.out.with_suffix(".png"))
    for t in out["targets"]:
        print(f"{t['figure']}: {t['config']} / {t['against']} = {t['ratio']} "
              f"(at most {t['at_most']}): {'met' if t['met'] else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
