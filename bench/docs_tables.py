"""The published figures' tables, generated from the committed JSON behind them.

A number typed into prose drifts from the run it came from; here every table between
`<!-- table:NAME -->` and `<!-- /table:NAME -->` in README.md and docs/*.md is rendered from the
JSON under bench/results/published/, with the command, date and machine that produced it.
`make docs` rewrites the tables, `make docs-check` (and tests/test_docs_tables.py) fails when a
committed table and its JSON disagree, or when a marker names no known table.

    python -m bench.docs_tables            # rewrite the tables in place
    python -m bench.docs_tables --check    # exit 1, naming each stale table
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PUBLISHED = Path("bench/results/published")
# A marker is a line of its own, so prose may name the syntax in backquotes.
MARKER = re.compile(r"^(?P<open><!-- table:(?P<name>[\w.-]+) -->\n)(?P<body>.*?)"
                    r"^(?P<close><!-- /table:(?P=name) -->)$", re.S | re.M)
OPENING = re.compile(r"^<!-- table:([\w.-]+) -->$", re.M)

MAIN_RUNS = ("main-job/run1.json", "main-job/run2.json", "main-job/run3.json")
MAIN_COMMAND = "agentserving compare --ablations"  # make run's four and the five ablations
DECODE_LONGCAP_RUNS = ("decode-longcap/run1.json", "decode-longcap/run2.json",
                       "decode-longcap/run3.json")
DECODE_LONGCAP_COMMAND = ("agentserving compare --ablations --decode-policy "
                          "'longcap-dynamic?short_order=shortest'")
DECODE_WAIT_RUNS = ("decode-longcap-wait/run1.json", "decode-longcap-wait/run2.json",
                    "decode-longcap-wait/run3.json")
DECODE_WAIT_COMMAND = ("agentserving compare --ablations --decode-policy 'longcap-dynamic?"
                       "short_order=shortest&max_long_running=4&long_cap=0.5"
                       "&long_max_wait_s=1'")
DECODE_MOONCAKE_RUNS = ("decode-longcap-mooncake/run1.json",
                        "decode-longcap-mooncake/run2.json",
                        "decode-longcap-mooncake/run3.json")
MOONCAKE_SAMPLE = ("--workload ../shared/data/mooncake/conversation_trace.jsonl --limit 40 "
                   "--time-scale 0.02")
DECODE_MOONCAKE_COMMAND = ("agentserving compare --configs vllm-precise,agentserving,"
                           "agentserving-fcfs " + MOONCAKE_SAMPLE + " --decode-policy "
                           "'longcap-dynamic?short_order=shortest&max_long_running=4"
                           "&long_cap=0.5&long_max_wait_s=1'")
BALANCED_RUNS = ("balanced-placement/agent-mix-run1.json",
                 "balanced-placement/agent-mix-run2.json")
BALANCED_COMMAND = ("agentserving compare --configs "
                    "vllm-precise,agentserving,agentserving-balanced")
BALANCED_MOONCAKE_RUNS = ("balanced-placement/mooncake-run1.json",
                          "balanced-placement/mooncake-run2.json")
BALANCED_MOONCAKE_COMMAND = BALANCED_COMMAND + " " + MOONCAKE_SAMPLE
ADMISSION_MOONCAKE_RUNS = ("admission-mooncake/run1.json", "admission-mooncake/run2.json")
ADMISSION_MOONCAKE_COMMAND = ("agentserving compare --configs vllm-precise,agentserving,"
                              "agentserving-noadmit " + MOONCAKE_SAMPLE)
MIX_RUNS = {
    "0.5": ("agent-mix/time-scale-0.5-run1.json", "agent-mix/time-scale-0.5-run2.json",
            "agent-mix/time-scale-0.5-run3.json"),
    "0.25": ("agent-mix/time-scale-0.25-run1.json", "agent-mix/time-scale-0.25-run2.json"),
}
MIX_COMMAND = {"0.5": "agentserving compare --configs "
                      "vllm-rr,vllm-session,vllm-precise,agentserving,agentserving-fcfs,"
                      "agentserving-noprefetch",
               "0.25": "agentserving compare --time-scale 0.25 --configs "
                       "vllm-rr,vllm-session,vllm-precise,agentserving,agentserving-fcfs,"
                       "agentserving-noprefetch"}
DISK_TIER = "disk-tier.json"
DISK_TIER_COMMAND = "python -m bench disk_tier"
# --tool-gap-scale of each run -> its report
ANNOUNCED = {1: "announced-turns/gap-scale-1.json", 10: "announced-turns/gap-scale-10.json"}
ANNOUNCED_COMMAND = ("agentserving compare --configs agentserving,agentserving-noprefetch "
                     "--cpu-cache-gib 0.15 --decode-policy "
                     "'longcap-dynamic?short_order=shortest&lookahead=5' --tool-gap-scale X")
TOOL_GAP_DISK = ("tool-gap-disk/dram-2.json", "tool-gap-disk/dram-0.25.json",
                 "tool-gap-disk/dram-0.13-gap-20.json")
TOOL_GAP_DISK_COMMAND = ("agentserving compare --configs agentserving,agentserving-noprefetch "
                         "--cpu-cache-gib X [--tool-gap-scale Y]")
KV_LIFECYCLE = "kv-lifecycle.json"
PD_TRANSFER = "pd-transfer.json"
PD_TRANSFER_COMMAND = "python -m bench pd_transfer"
LAYERWISE_RELOAD = "layerwise-reload-h100.json"
LAYERWISE_RELOAD_COMMAND = "python -m bench layerwise_reload --repeats 5"
KV_LIFECYCLE_COMMAND = "python -m bench kv_lifecycle"
PREFIX_STABILITY = "prefix-stability.json"
PREFIX_STABILITY_COMMAND = "python -m bench prefix_stability"
PROXY_REPLICAS = "proxy-replicas.json"
PROXY_REPLICAS_COMMAND = "python -m bench proxy_replicas"
# --lookups of each run -> its result
CONTROL_PLANE = {"replica": "control-plane-load/replica.json",
                 "kvindex": "control-plane-load/kvindex.json"}
CONTROL_PLANE_COMMAND = "python -m bench control_plane_load [--lookups kvindex]"
PROXY, PROXY_COMMAND = "proxy.json", "python -m bench proxy"
CONCURRENCY, CONCURRENCY_COMMAND = "concurrency.json", "python -m bench concurrency"
SOAK = "soak.json"
SOAK_COMMAND = "python -m bench soak --duration-s 420 --change-feed-max 1000"
SOAK_VLLM = "soak-vllm.json"
SOAK_VLLM_COMMAND = ("python -m bench soak --engine vllm --duration-s 1800 --sample-s 15 "
                     "--change-feed-max 1000")
FAULTS, FAULTS_COMMAND = "faults.json", "python -m bench faults"
FAULTS_VLLM, FAULTS_VLLM_COMMAND = "faults-vllm.json", "python -m bench faults --engine vllm"
PREFILL_SCHED, PREFILL_SCHED_COMMAND = "prefill-sched.json", "python -m bench prefill_sched"
KERNELS, KERNELS_COMMAND = "kernels.json", "python -m bench kernels"
REFERENCE_RUNS = ("reference-quick-run/run1.json", "reference-quick-run/run2.json")
REFERENCE_COMMAND = "agentserving compare --engine reference"
PROXY_CPU, PROXY_CPU_COMMAND = "proxy-cpu.json", "python -m bench proxy_cpu"
AGENT_PRESSURE = "agent-pressure.json"
AGENT_PRESSURE_COMMAND = ("python -m bench agent_pressure --from-run RUN --rename "
                          "agentserving=agentserving-toolpin "
                          "--rename agentserving-nopin=agentserving")
AGENT_PRESSURE_PREFETCH = "agent-pressure-prefetch.json"
AGENT_PRESSURE_PREFETCH_COMMAND = ("python -m bench agent_pressure --configs "
                                   "agentserving,agentserving-noprefetch")
AGENT_PRESSURE_HOLD = "agent-pressure-hold.json"
AGENT_PRESSURE_HOLD_COMMAND = ("python -m bench agent_pressure --from-run RUN --rename "
                               "agentserving=agentserving-hold")
SIM_VALIDATION = "sim/validation-and-seed.json"
SIM_VALIDATION_COMMAND = ("python -m bench sim --parts 1,2 --real sim/validation/run3-report.json "
                          "... --real sim/validation/run10-report.json")
SIM_SCALE = ("sim/scale.json", "sim/scale-100k.json")
SIM_SCALE_COMMAND = ("python -m bench sim --parts 3 --scale 4:1000,16:4000,64:16000 --per-pod "
                     "0.5; python -m bench sim --parts 3 --scale 64:100000 --per-pod 0.4")


@dataclass(frozen=True)
class Doc:
    """Where a table is rendered: links to the JSON are relative to the page's folder."""

    root: Path  # the repository, where bench/results/published/ lies
    folder: Path  # the page's folder, relative to root

    def link(self, published: str, text: str | None = None) -> str:
        rel = os.path.relpath(PUBLISHED / published, self.folder)
        return f"[{text or Path(published).name}]({rel})"


@cache
def _load(root: Path, name: str) -> dict:
    return json.loads((root / PUBLISHED / name).read_text())


def _ratio(x: float) -> str:
    return f"×{x:.2f}"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f} %"


def _yes(ok: bool) -> str:
    """A target's verdict; a miss stands out."""
    return "yes" if ok else "**no**"


def _s(x: float) -> str:
    return f"{x:.2f} s"


def _date(report: dict) -> str:
    return str(report.get("created", "?"))[:10]


def _machine(report: dict) -> str:
    m = report.get("machine", {})
    return f"{m.get('cpus', '?')} CPUs, Python {m.get('python', '?')}"


def _source_line(doc: Doc, command: str, reports: list[tuple[str, dict]]) -> str:
    dates = sorted({_date(r) for _, r in reports})
    machines = sorted({_machine(r) for _, r in reports})
    links = ", ".join(doc.link(name) for name, _ in reports)
    took = [r["duration_s"] for _, r in reports if "duration_s" in r]
    wall = f", {' / '.join(f'{t:.0f}' for t in took)} s each" if took else ""
    return (f"Command: `{command}`, once per run; run on {', '.join(dates)}{wall}, "
            f"{'; '.join(machines)}; JSON: {links}.")


def _checks(report: dict) -> list[tuple[str, dict]]:
    """Every target a run checked, as `agentserving compare` counts them."""
    out = [(f"vs {rival}: {name}", c) for rival, comp in report["comparisons"].items()
           for name, c in comp.get("checks", {}).items()]
    out += list(report.get("run_checks", {}).items())
    return out


def _met(report: dict) -> tuple[int, int]:
    checks = _checks(report)
    return sum(1 for _, c in checks if c["ok"]), len(checks)


def _cell(reports: list[dict], get: Callable[[dict], float], fmt: Callable[[float], str]) -> str:
    """One figure across runs; a run whose report predates the figure shows a dash."""
    def one(r: dict) -> str:
        try:
            return fmt(get(r))
        except KeyError:
            return "–"
    return " / ".join(one(r) for r in reports)


def _target(t: str) -> str:
    """`>= 2` as the docs write a ratio target: `≥ ×2`."""
    op, _, value = str(t).partition(" ")
    v = float(value.split(" ")[0])
    return f"{'≥' if op == '>=' else '≤'} ×{v:.2f}".rstrip("0").rstrip(".")


def _comparison_table(doc: Doc, names: tuple[str, ...], rivals: list[str] | None,
                      command: str, short_ttft: bool = True) -> str:
    reports = [_load(doc.root, n) for n in names]
    runs = " / ".join(str(i + 1) for i in range(len(reports)))
    metrics = [("req/s", "req_per_s"), ("E2E P95", "e2e_p95_s")]
    if short_ttft:
        metrics += [("short turns' TTFT P50", "ttft_p50_short_s"),
                    ("short turns' TTFT P85", "ttft_p85_short_s")]
    head = f"| agentserving vs (run {runs}) | " + " | ".join(m for m, _ in metrics) + " |"
    lines = [head, "| --- " * (len(metrics) + 1) + "|"]
    rivals = rivals or list(reports[0]["comparisons"])
    for rival in rivals:
        targets = list(dict.fromkeys(
            _target(c["target"]) for r in reports
            for name, c in r["comparisons"][rival].get("checks", {}).items()
            if name.endswith("_ratio")))
        label = f"{rival} ({', '.join(targets)})" if targets else f"{rival} (ablation)"
        cells = [_cell(reports, lambda r, k=k, v=rival: r["comparisons"][v]["ratios"][k], _ratio)
                 for _, k in metrics]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    met = ", ".join(f"{a} of {b}" for a, b in (_met(r) for r in reports))
    source = _source_line(doc, command, list(zip(names, reports, strict=True)))
    lines += ["", f"Targets met: {met}. " + source]
    return "\n".join(lines)


def _absolute_table(doc: Doc, names: tuple[str, ...], command: str | None = None) -> str:
    """Each configuration's own figures; with ``command``, E2E P50 too and where the runs
    come from (a table that stands alone, not beside a ratio table of the same runs)."""
    reports = [_load(doc.root, n) for n in names]
    cols = [("req/s", "req_per_s", lambda x: f"{x:.2f}"), ("E2E P95", "e2e_p95_s", _s),
            ("short TTFT P50", "ttft_p50_short_s", _s), ("short TTFT P85", "ttft_p85_short_s", _s),
            ("prefix hit", "prefix_hit_rate", _pct), ("failed turns", "turns_failed", str),
            ("forced mismatches", "forced_mismatches", str)]
    if command is not None:
        cols.insert(1, ("E2E P50", "e2e_p50_s", _s))
    runs = " / ".join(str(i + 1) for i in range(len(reports)))
    lines = [f"| configuration (run {runs}) | " + " | ".join(c for c, _, _ in cols) + " |",
             "| --- " * (len(cols) + 1) + "|"]
    for cfg in reports[0]["configs"]:
        cells = [_cell(reports, lambda r, k=k, c=cfg: r["configs"][c][k], f) for _, k, f in cols]
        lines.append(f"| {cfg} | " + " | ".join(cells) + " |")
    short = reports[0]["configs"]["agentserving"]["short_turns"]
    turns = reports[0]["configs"]["agentserving"]["turns_planned"]
    lines += ["", f"Short turns: the {short} of {turns} turns whose uncached prompt is under "
                  "512 tokens, the same in every configuration."]
    if command is not None:
        lines[-1] += " " + _source_line(doc, command, list(zip(names, reports, strict=True)))
    return "\n".join(lines)


def _checks_table(doc: Doc, names: tuple[str, ...]) -> str:
    reports = [_load(doc.root, n) for n in names]
    runs = " / ".join(str(i + 1) for i in range(len(reports)))
    lines = [f"| target | value (run {runs}) | met |", "| --- | --- | --- |"]
    for label, first in _checks(reports[0]):
        values, oks = [], []
        for r in reports:
            c = dict(_checks(r)).get(label)
            values.append("–" if c is None else _num(c["value"]))
            oks.append("–" if c is None else _yes(c["ok"]))
        target = str(first["target"]).split(" (")[0]
        lines.append(f"| {label} `{target}` | {' / '.join(values)} | {' / '.join(oks)} |")
    return "\n".join(lines)


def _num(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def _by_source_table(doc: Doc, names: tuple[str, ...]) -> str:
    reports = [_load(doc.root, n) for n in names]
    sources = list(reports[0]["workload"]["by_source"])
    cfgs = ["agentserving", "vllm-precise", "vllm-rr"]
    lines = ["| source | sessions | turns | ideal hit | " + " | ".join(cfgs)
             + " | production cache |", "| --- " * (len(cfgs) + 5) + "|"]
    for s in sources:
        w = reports[0]["workload"]["by_source"][s]
        hits = [_cell(reports,
                      lambda r, c=c, s=s: r["configs"][c]["by_source"][s]["prefix_hit_rate"],
                      _pct) for c in cfgs]
        ref = _pct(w.get("reference_hit_rate"))
        lines.append(f"| {s} | {w['sessions']} | {w['turns']} | {_pct(w['ideal_hit_rate'])} | "
                     + " | ".join(hits) + f" | {ref} |")
    return "\n".join(lines)


def _shadow_table(doc: Doc, names: tuple[str, ...]) -> str:
    reports = [_load(doc.root, n) for n in names]
    keys = ("accuracy", "precision", "recall")
    lines = ["| N+1 window (prefill pod, live) | " + " | ".join(keys) + " |",
             "| --- " * (len(keys) + 1) + "|"]
    for cfg in reports[0].get("shadow", {}):
        lines.append(f"| {cfg} (run {' / '.join(str(i + 1) for i in range(len(reports)))}) | "
                     + " | ".join(_cell(reports, lambda r, k=k, c=cfg: r["shadow"][c][k], _pct)
                                  for k in keys) + " |")
    seed = reports[0]["shadow"]["agentserving"]["seed_003"]
    lines.append("| seed 003 (reported) | " + " | ".join(_pct(seed[k]) for k in keys) + " |")
    return "\n".join(lines)


def _kv_wait_table(doc: Doc, names: tuple[str, ...]) -> str:
    reports = [_load(doc.root, n) for n in names]
    lines = ["| run | DRAM per pod | agentserving KV wait P50 | forward P50 | "
             "share (target ≤ 10 %) | disk read (O_DIRECT) | per 2 MiB chunk P50 | "
             "announced sessions' chunks on disk |",
             "| --- " * 8 + "|"]
    for i, r in enumerate(reports):
        st = r["configs"]["agentserving"]["steps"]
        disk = r["settings"]["disk_tier"]["reads"]
        gap = (r.get("tool_gap_prefetch") or {}).get("agentserving")
        on_disk = (f"{_pct(gap['disk_share'])} of {sum(gap['chunks'].values()):,}"
                   if gap else "–")
        lines.append(f"| {i + 1} | {r['settings']['cpu_cache_gib']:g} GiB | "
                     f"{1000 * st['kv_wait_exposed_p50_s']:.1f} ms | "
                     f"{1000 * st['forward_p50_s']:.0f} ms | {_pct(st['kv_wait_share_p50'])} | "
                     f"{disk['read_gbps']:.2f} GB/s | {disk['read_p50_ms']:.1f} ms | {on_disk} |")
    return "\n".join(lines)


def _disk_tier_table(doc: Doc) -> str:
    r = _load(doc.root, DISK_TIER)
    lines = ["| reload from | P50 | P95 | per chunk P50 | GB/s | ×DRAM |",
             "| --- | --- | --- | --- | --- | --- |"]
    for tier, v in r["reload"].items():
        lines.append(f"| {tier} | {v['reload_p50_ms']:.1f} ms | {v['reload_p95_ms']:.1f} ms | "
                     f"{v['per_chunk_p50_ms']:.2f} ms | {v['gbps']:.2f} | "
                     f"{_ratio(v.get('vs_dram_p50', 1.0))} |")
    for io, v in r["probe"].items():
        lines.append(f"| raw probe, {io} ({v['chunks']} chunk files) | {v['read_p50_ms']:.2f} ms "
                     f"| {v['read_p95_ms']:.2f} ms | | {v['read_gbps']:.2f} | |")
    return _finish(doc, lines, DISK_TIER_COMMAND, (DISK_TIER,),
                   f"Model: {r.get('model', '?')}; torch {r.get('host', {}).get('torch', '?')}. ")


def _after_gap_cells(r: dict, *, turns: bool) -> str:
    """agentserving's TTFT P50 after a tool gap (with its turn count) | the no-prefetch
    ablation's, with agentserving's ratio to it."""
    cand, ablation = r["configs"]["agentserving"], r["configs"]["agentserving-noprefetch"]
    ratio = cand["ttft_p50_after_gap_s"] / ablation["ttft_p50_after_gap_s"]
    count = f" ({cand['after_gap_turns']})" if turns else ""
    return (f"{_s(cand['ttft_p50_after_gap_s'])}{count} | "
            f"{_s(ablation['ttft_p50_after_gap_s'])} ({_ratio(ratio)})")


def _announced_table(doc: Doc) -> str:
    """Turns announced during tool calls: what became of them, what they read, and TTFT after a
    tool gap against the configuration without prefetch, one row per --tool-gap-scale."""
    lines = ["| --tool-gap-scale | announced | arrived | reads started: by the N+1 window / on "
             "an idle pod | started before the turn arrived | disk chunks read | TTFT after a "
             "tool gap, P50 (turns) | without prefetch |", "| --- " * 8 + "|"]
    reports = []
    for scale, name in ANNOUNCED.items():
        r = _load(doc.root, name)
        reports.append((name, r))
        a = r["shadow"]["agentserving"]["announced"]
        read = r["shadow"]["agentserving"]["prefetch"]["chunks"]
        lines.append(f"| {scale} | {a['announced']} | {a['arrived']} | "
                     f"{a['fired_by_window']} / {a['fired_idle']} | "
                     f"{a['prefetched_before_arrival']} | {read} | "
                     f"{_after_gap_cells(r, turns=True)} |")
    lines += ["", _source_line(doc, ANNOUNCED_COMMAND, reports)]
    return "\n".join(lines)


def _tool_gap_disk_table(doc: Doc) -> str:
    """Where the pods found the KV of the sessions announced during their tool calls, by DRAM
    per pod and tool-gap length, beside TTFT after a tool gap with and without the prefetch."""
    lines = ["| DRAM per pod | --tool-gap-scale | announced sessions' chunks: in DRAM / on disk / "
             "left to the pod's scheduler | TTFT after a tool gap, P50 | without prefetch |",
             "| --- " * 5 + "|"]
    reports = []
    for name in TOOL_GAP_DISK:
        r = _load(doc.root, name)
        reports.append((name, r))
        found = r["tool_gap_prefetch"]["agentserving"]["chunks"]
        lines.append(f"| {r['settings']['cpu_cache_gib']:g} GiB | "
                     f"{r['settings']['tool_gap_scale']:g} | {found['dram']:,} / "
                     f"{found['disk']:,} / {found['scheduled']:,} | "
                     f"{_after_gap_cells(r, turns=False)} |")
    lines += ["", _source_line(doc, TOOL_GAP_DISK_COMMAND, reports)]
    return "\n".join(lines)


def _kv_lifecycle_table(doc: Doc) -> str:
    """Agents through tool gaps on a pod other traffic keeps overflowing, pinned or not."""
    r = _load(doc.root, KV_LIFECYCLE)
    lines = ["| run | mean job completion time | TTFT after a tool gap, P50 / P90 | cached "
             "prompt tokens after a gap (mean) | flood requests |",
             "| --- | --- | --- | --- | --- |"]
    for mode in ("unpinned", "pinned"):
        v = r[mode]
        lines.append(f"| {mode} | {_s(v['mean_jct_s'])} | {_s(v['ttft_after_gap_p50_s'])} / "
                     f"{_s(v['ttft_after_gap_p90_s'])} | "
                     f"{v['cached_tokens_after_gap_mean']:,.0f} | {v['flood_requests']} |")
    ratio = r["ratios"]
    lines += ["", f"Pinned against unpinned: mean job completion time "
                  f"{_ratio(ratio['mean_jct'])} lower (target ≥ "
                  f"{_ratio(r['target_mean_jct_ratio_min'])}), TTFT after a gap "
                  f"{_ratio(ratio['ttft_after_gap_p50'])} lower. {r['agents']} agents × "
                  f"{r['turns']} turns ({r['context_tokens']:,}-token context, "
                  f"+{r['append_tokens']} a turn, {r['gap_s']:g} s tool gaps, pins of "
                  f"{r['pin_ttl_s']:g} s) on one {r['engine']} pod ({r['model']}, "
                  f"{r['device_blocks']} device KV blocks, {r['cpu_cache_gib']:g} GiB of DRAM, "
                  f"pin share {r['pin_share']:g}) beside {r['flood_streams']} streams of "
                  f"{r['flood_tokens']:,}-token one-shot prompts. Command: "
                  f"`{KV_LIFECYCLE_COMMAND}`, run on {_date(r)} ({r['seconds']:.0f} s, "
                  f"{r['environment']['cpus']} CPUs, Python {r['environment']['python']}); "
                  f"JSON: {doc.link(KV_LIFECYCLE)}."]
    return "\n".join(lines)


def _pd_transfer_table(doc: Doc) -> str:
    """The P -> D hand-off on vLLM, point to point vs a central KV server, by prompt size."""
    r = _load(doc.root, PD_TRANSFER)
    rows = []
    for size in map(str, r["sizes"]):
        for mode, label in (("p2p", "point to point"), ("server", "central server")):
            v = r[mode][size]
            gbps = v["throughput_gbps"]
            rows.append([f"{int(size):,}", label, f"{v['kv_bytes'] / 1e6:,.0f} MB",
                         _s(v["prefill_s"]), _s(v["decode_ttft_s"]), _s(v["local_ttft_s"]),
                         _s(v["added_ttft_s"]), "–" if gbps is None else f"{gbps:.2f} GB/s"])
    lines = _md(["prompt tokens", "hand-off", "KV", "prefill (KV written)",
                 "decode pod's first token", "same, KV in its own DRAM", "added by the hand-off",
                 "throughput"], rows)
    ratios = "; ".join(f"{int(k):,} tokens {_ratio(v['decode_ttft_p2p_vs_server'])}"
                       for k, v in r["ratios"].items())
    return _finish(doc, lines, PD_TRANSFER_COMMAND, (PD_TRANSFER,),
                   f"P50 of {r['reps']} prompts per size and hand-off, 1 prefill + 1 decode "
                   f"vLLM pod ({r['model']}), each KV server bounded at "
                   f"{r['kv_transfer_gib']:g} GiB. The decode pod's first token, point to point "
                   f"against the central server: {ratios}. ")


def _layerwise_reload_table(doc: Doc) -> str:
    """A cached context reloaded whole vs layer by layer on a GPU, next to its forward."""
    r = _load(doc.root, LAYERWISE_RELOAD)
    c = r["config"]
    rows = []
    for case in r["cases"]:
        p, e, share = case["p50_ms"], case["exposed_kv_wait_ms"], case["exposed_share_of_forward"]
        rows.append([f"{case['context']:,}", f"{case['chunk']:,}",
                     f"{case['kv_bytes'] / 2**30:g} GiB", _ms(p["resident"]),
                     f"{_ms(e['whole'])} ({share['whole']:.1%})",
                     f"{_ms(e['layerwise'])} ({share['layerwise']:.1%})",
                     f"{case['reload_GBps_whole']:.0f} GB/s"])
    lines = _md(["cached tokens D", "new tokens C", "KV", "forward, KV resident",
                 "KV wait, whole reload", "KV wait, layer-wise", "host -> GPU"], rows)
    return _finish(doc, lines, LAYERWISE_RELOAD_COMMAND, (LAYERWISE_RELOAD,),
                   f"P50 of {c['repeats']} rounds, the three ways alternating; {r['staging']}, "
                   f"torch {r['torch']}; {c['layers']} decoder layers of hidden {c['hidden']}, "
                   f"{c['heads']} query and {c['kv_heads']} KV heads, MLP {c['ffn']}, "
                   f"{c['dtype']} (an 8B model's shapes, random weights). ")


def _prefix_stability_table(doc: Doc) -> str:
    r = _load(doc.root, PREFIX_STABILITY)
    labels = {"template as is": "the template as is (the call in `tool_calls`)",
              "tool calls in the text": "tool calls written into the text (the importer's choice)"}
    lines = ["| replies sent back | prefix-stable turns | breaks |", "| --- | --- | --- |"]
    for mode, v in r["modes"].items():
        breaks = ", ".join(f"{why}: {n:,}" for why, n in v["breaks"].items()) or "none"
        lines.append(f"| {labels.get(mode, mode)} | {v['stable']:,} of {v['turns']:,} "
                     f"({_pct(v['stable_share'])}) | {breaks} |")
    c = r["counting"]
    return _finish(doc, lines, PREFIX_STABILITY_COMMAND, (PREFIX_STABILITY,),
                   f"{r['sessions']} sessions of `{Path(r['src']).name}`, model {r['model']}, "
                   f"template {r['template']}, {r['wall_s']:.0f} s. Counting the prompts of "
                   f"{c['timed_sessions']} sessions ({c['calls']:,} calls, {c['prompt_tokens']:,} "
                   f"tokens): whole prompts "
                   f"{c['whole_prompts_s']:.1f} s, `PromptCounter` {c['counter_s']:.2f} s. ")


def _agent_pressure_table(doc: Doc, name: str = AGENT_PRESSURE,
                          command: str = AGENT_PRESSURE_COMMAND) -> str:
    """The pressure workload's figures per configuration: median [min-max] of the repeats,
    then each target judged on the medians."""
    r = _load(doc.root, name)
    figures = (("mean_jct_s", "mean session time"),
               ("ttft_p50_after_human_pause_s", "TTFT P50 after a human pause"),
               ("e2e_p95_s", "E2E P95"), ("branch_start_ttft_p90_s", "branch-start TTFT P90"),
               ("req_per_s", "req/s"), ("hit_vs_ideal", "hit / ideal"),
               ("failed_turns", "failed turns"), ("forced_mismatches", "forced mismatches"))
    if any(c["median"].get("disk_read_critical_s") is not None for c in r["configs"].values()):
        figures += (("disk_read_critical_s", "disk reads on the critical path"),)

    def cell(c: dict, key: str) -> str:
        med, lo, hi = (c[k].get(key) for k in ("median", "min", "max"))
        if med is None:
            return "-"
        fmt = _pct if key == "hit_vs_ideal" else (
            _num if key in ("failed_turns", "forced_mismatches") else
            (lambda x: f"{x:.2f}") if key == "req_per_s" else _s)
        return fmt(med) if lo == hi else f"{fmt(med)} [{fmt(lo)}–{fmt(hi)}]"

    lines = _md(["config", *(label for _, label in figures)],
                [[f"`{name}`", *(cell(c, key) for key, _ in figures)]
                 for name, c in r["configs"].items()])
    verdicts = "; ".join(
        f"{t['figure']} {t['config']} / {t['against']} ×{t['ratio']:.2f} (≤ ×{t['at_most']:.2f}: "
        f"{_yes(t['met'])})" for t in r["targets"] if t["ratio"] is not None)
    renamed = "; ".join(f"`{ran}` reported as `{name}`" for ran, name in r["renamed"].items())
    return _finish(doc, lines, command, (name,),
                   f"Medians of {r['repeats']} interleaved repeats, [min–max] beside them. "
                   + (f"Targets on the medians: {verdicts}. " if verdicts else "")
                   + f"Compare: `{r['compare_command']}` "
                   f"({r['seconds']:.0f} s in all)" + (f", its configurations {renamed} (the "
                   "names their flags have now)" if renamed else "") + ". ")


def _ms(x: float) -> str:
    return f"{x:.2f} ms"


def _run_line(doc: Doc, command: str, names: tuple[str, ...]) -> str:
    """The command a table's JSON came from, and the date and machine each JSON records
    (``bench.common.provenance``)."""
    runs = [_load(doc.root, n)["run"] for n in names]
    dates = sorted({f"{r['created'][:10]} {r['created'][11:16]} UTC" for r in runs})
    machines = sorted({f"{m['cpus']} CPUs ({m['cpu']}, {m['arch']}), Python {m['python']}"
                       for m in (r["machine"] for r in runs)})
    links = ", ".join(doc.link(n) for n in names)
    return (f"Command: `{command}`; run on {', '.join(dates)}, {'; '.join(machines)}; "
            f"JSON: {links}.")


def _md(head: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table's lines: the header, its rule, one line per row."""
    return ["| " + " | ".join(row) + " |" for row in [head, ["---"] * len(head), *rows]]


def _finish(doc: Doc, lines: list[str], command: str, names: tuple[str, ...],
            note: str = "") -> str:
    """A table's rows, then what the reader needs to reproduce them: ``note`` (the run's
    sizes and verdicts) and the command, date, machine and JSON of ``_run_line``."""
    return "\n".join([*lines, "", note + _run_line(doc, command, names)])


def _proxy_replicas_table(doc: Doc) -> str:
    r = _load(doc.root, PROXY_REPLICAS)
    labels = {"one": "one proxy", "plain": "three replicas, nothing shared",
              "shared": "three, `--shared-sessions`",
              "prompt-hash": "three, `--prompt-hash-scheme blake3`"}
    within = r["target"]["within"]
    lines = ["| configuration | later turns on the session's previous pod | prompt tokens from "
             "cache | vs one proxy, points (pod / cache) | within "
             f"{100 * within:g} point of one proxy | latency P50 / P99 |", "| --- " * 6 + "|"]
    for name, c in r["configs"].items():
        lat, vs = c["latency_ms"], r["vs_one_proxy"][name]
        met = r["target"]["met"].get(name)
        lines.append(f"| {labels.get(name, name)} | {_pct(c['later_turns_on_previous_pod'])} | "
                     f"{_pct(c['cached_share'])} | {100 * vs['on_previous_pod_diff']:+.1f} / "
                     f"{100 * vs['cached_share_diff']:+.1f} | "
                     f"{'–' if met is None else _yes(met)} | "
                     f"{lat['p50']:.1f} / {lat['p99']:.0f} ms |")
    return _finish(doc, lines, PROXY_REPLICAS_COMMAND, (PROXY_REPLICAS,),
                   f"{r['sessions']} sessions of {r['turns_per_session']} turns per "
                   f"configuration. ")


def _control_plane_table(doc: Doc) -> str:
    labels = {"replica": "its in-process residency replica (default)",
              "kvindex": "the kvindex, a round trip (`--lookups kvindex`)"}
    rows = []
    for name in CONTROL_PLANE.values():
        r = _load(doc.root, name)
        added, routing, rss = r["added_ms"], r["proxy_routing_ms_histogram"], r["peak_rss_mib"]
        rows.append([
            labels[r["config"]["lookups"]], f"{r['turns']:,} ({r['errors']['total']})",
            f"{r['turns_per_s']:.0f}", _ms(added["p50_ms"]), _ms(added["p99_ms"]),
            f"{routing['p50_ms']:.2f} / {routing['p99_ms']:.2f} ms",
            f"{r['routing']['same_pod_as_previous_turn']:,} of {r['routing']['later_turns']:,}",
            f"{rss['proxy']:.0f} / {rss['kvindex']:.0f} / {rss['redis']:.0f} MiB"])
    lines = _md(["proxy looks each turn up in", "turns (errors)", "turns/s", "added P50",
                 "added P99 (target < 10 ms)", "proxy routing P50 / P99",
                 "later turns on the pod holding the context",
                 "peak RSS: proxy / kvindex / Redis"], rows)
    return _finish(doc, lines, CONTROL_PLANE_COMMAND, tuple(CONTROL_PLANE.values()))


def _proxy_overhead_table(doc: Doc) -> str:
    r = _load(doc.root, PROXY)
    labels = {"kv-aware-1": "kv-aware, 1 prefill pod (nothing to look up)",
              "round-robin-4": "round-robin, 4 pods",
              "kv-aware-4": "kv-aware, 4 pods, in-process replica",
              "kv-aware-4-kvindex": "kv-aware, 4 pods, kvindex round trip"}
    target = r["target"]
    rows = []
    for name, a in r["added_ms"].items():
        label = labels.get(name, name)
        if name == target["path"]:
            label = f"**{label}** (target: P50 < {target['added_p50_ms_max']:g} ms)"
        rows.append([label, _ms(a["p50"]), _ms(a["p99"])])
    lines = _md(["path", "added P50", "added P99"], rows)
    return _finish(doc, lines, PROXY_COMMAND, (PROXY,),
                   f"{r['turns']:,} turns per path, {r['workers']} workers, a "
                   f"{r['prompt_tokens']:,}-token prompt; target met: "
                   f"{_yes(target['met'])}. ")


def _concurrency_table(doc: Doc) -> str:
    r = _load(doc.root, CONCURRENCY)
    knee = r["knee"]["agents"]
    rows = []
    for row in r["levels"]:
        cells = [str(row["agents"]) + (" (knee)" if row["agents"] == knee else ""),
                 f"{row['turns_per_s']:.2f}", f"{row['p50_ms']:,.0f} ms",
                 f"{row['p95_ms']:,.0f} ms", str(row["failed"])]
        rows.append([f"**{c}**" for c in cells] if row["agents"] == knee else cells)
    lines = _md(["agents", "turns/s", "E2E P50", "E2E P95", "failed turns"], rows)
    c = r["config"]
    return _finish(doc, lines, CONCURRENCY_COMMAND, (CONCURRENCY,),
                   f"{c['step_s']:g} s a level; the knee: {r['knee']['why']}. ")


def _soak_table(doc: Doc, name: str = SOAK, command: str = SOAK_COMMAND) -> str:
    """Every sampled series: its first value, the middle and last thirds' maxima, and the
    bench's verdict on it."""
    r = _load(doc.root, name)

    def row(name: str, v: dict) -> list[str]:
        num = "{:,.1f}" if name.endswith("MiB table") else "{:,.0f}"
        return [name, " -> ".join(num.format(v[k]) for k in ("first", "middle_max", "last_max")),
                "**yes**" if name in r["growing"] else "no"]

    series = r["series"]
    order = sorted(series, key=lambda n: (n.endswith(" table"), n))
    lines = _md(["series (RSS and tables' sizes in MiB, else counts)",
                 "first -> middle third's max -> last third's max", "growing"],
                [row(n, series[n]) for n in order])
    return _finish(doc, lines, command, (name,),
                   f"{r['duration_s']:.0f} s, {r['agents']} agents: {r['turns']:,} turns "
                   f"({r['turns_per_s']:.2f}/s), {r['sessions_closed']:,} sessions closed, "
                   f"{r['failed_turns']} failed; no failed turn and nothing growing: "
                   f"{_yes(r['target']['met'])}. ")


def _faults_table(doc: Doc, name: str = FAULTS, command: str = FAULTS_COMMAND) -> str:
    r = _load(doc.root, name)
    lines = ["| fault | turns failed (for good) | retried by the proxy unseen | failed after "
             "tokens (retriable) | silent cuts | wrong outputs | first good turn after | fleet "
             "healthy after |", "| --- " * 8 + "|"]

    def sec(v: float | None) -> str:
        return "–" if v is None else f"{v:.2f} s"

    for f in r["faults"].values():
        if f.get("skipped"):
            lines.append(f"| {f['fault']} | skipped: {f['skipped']} | | | | | | |")
            continue
        at = f["failed_after_tokens"]
        lines.append(f"| {f.get('what') or f['fault']} | {f['turns_failed']} "
                     f"({f['turns_failed_for_good']}) | {f['turns_retried_transparently']} | "
                     f"{at['total']} ({at['retriable']}) | {f['silent_cuts']} | "
                     f"{f['wrong_outputs']} | {sec(f['recovery_s'])} | {sec(f['healthy_s'])} |")
    w = r["config"]["workload"]
    met = ", ".join(f"{k.replace('_', ' ')}: {_yes(v['met'])}" for k, v in r["targets"].items())
    return _finish(doc, lines, command, (name,),
                   f"{w['sessions']} sessions x {w['turns']} turns per fleet; fault-free runs "
                   f"agree token for token: {_yes(r['reference_reproducible'])}; "
                   f"targets: {met}; {r['duration_s']:.0f} s in all. ")


def _prefill_sched_table(doc: Doc) -> str:
    r = _load(doc.root, PREFILL_SCHED)
    ratios = r["ratios_vs_fcfs_nochunk"]
    lines = ["| policy | P50 / P85 / P95 / P99 | P50 × | P85 × | P95 / fcfs's |",
             "| --- | --- | --- | --- | --- |"]
    for name, v in r["policies"].items():
        lat = v["latency_s"]
        cells = [" / ".join(f"{lat[k]:.2f}" for k in ("p50", "p85", "p95", "p99")) + " s"]
        x = ratios.get(name)
        cells += ([f"{x['p50_speedup']:.1f}", f"{x['p85_speedup']:.1f}", f"{x['p95_ratio']:.2f}"]
                  if x else ["", "", ""])
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    seed, coef, t = r["seed_003"], r["calibration"]["coef"], r["trace"]
    kv = r["calibration"].get("kv_load_s_per_chunk", {})
    lines.append(f"| seed 003 (reported, longcap vs fcfs) | | {seed['p50_speedup']:g} | "
                 f"{seed['p85_speedup']:g} | {seed['p95_ratio']:.2f} |")
    cal = ", ".join(f"{coef[k]:.3g}" for k in ("a_s", "b_s_per_new_token",
                                              "c_s_per_context_token", "d_s_per_attention_pair"))
    return _finish(doc, lines, PREFILL_SCHED_COMMAND, (PREFILL_SCHED,),
                   f"{t['requests']:,} turns at {t['rate_per_s']:.3f}/s (offered load "
                   f"{t['offered_load']:g} of fcfs no-chunk; fcfs utilization "
                   f"{r['policies']['fcfs-nochunk']['utilization']:.2f}); calibration a, b, c, d "
                   f"= {cal}; KV load per chunk {1000 * kv.get('cpu', 0):.2f} ms DRAM, "
                   f"{1000 * kv.get('disk', 0):.2f} ms disk; {r['wall_s']:.0f} s wall. ")


def _prefill_shadow_table(doc: Doc) -> str:
    r = _load(doc.root, PREFILL_SCHED)
    keys = ("accuracy", "precision", "recall")
    lines = ["| N+1 window | accuracy | precision | recall | consumption | survival | N+1 ETA "
             "error, P50 / P95 |", "| --- " * 7 + "|"]
    seed = r["seed_003"]
    lines.append("| seed 003 (reported) | " + " | ".join(_pct(seed[f"n1_{k}"]) for k in keys)
                 + f" | {_pct(seed['prefetch_consumption'])} | {_pct(seed['prefetch_survival'])}"
                 " | |")
    for name, v in r["policies"].items():
        n1, pf = v.get("n_plus_1_prediction"), v.get("prefetch")
        if n1 is None:
            continue
        eta = n1["n1_eta_error_s"]
        lines.append(f"| {name} | " + " | ".join(_pct(n1[k]) for k in keys)
                     + f" | {_pct(pf['consumption_precision'])} | {_pct(pf['survival'])} | "
                     f"{eta['p50_abs']:.2f} / {eta['p95_abs']:.2f} s |")
    speed = r.get("planner_speed", {})
    if speed:
        same = all(v["same_results"] for v in speed.values())
        lines += ["", "Planner, fast vs reference (`planner_speed`, the same replay): " + "; ".join(
            f"{name} {v['reference_s']:.2f} -> {v['fast_s']:.2f} s (×{v['speedup']:.1f})"
            for name, v in speed.items()) + f"; same decisions: {_yes(same)}."]
    return "\n".join(lines)


def _kernels_table(doc: Doc) -> str:
    """Staging one copy against many small ones, and the worker's restore and store paths."""
    r = _load(doc.root, KERNELS)
    c, st, wp, seed = r["config"], r["staging_cpu_reference"], r["worker_path_cpu"], r["seed_003"]
    small = next(k for k in st if k.startswith("per_block_") and "_kv_" not in k)
    kv = next(k for k in st if k.startswith("per_block_kv_"))
    lines = ["| path (CPU, the PyTorch reference) | P50 | × the one-copy / paged path |",
             "| --- | --- | --- |",
             f"| stage {c['blocks']} blocks x {c['layers']} layers "
             f"({st['bytes'] / 2**20:.0f} MiB): one staged copy | "
             f"{st['staged_one_copy']['p50_ms']:.1f} ms | ×1.00 |",
             f"| the same as {st[small]['copies']:,} per-(layer, block) copies | "
             f"{st[small]['p50_ms']:.1f} ms | {_ratio(st['ratio_small_over_staged'])} |",
             f"| the same as {st[kv]['copies']:,} per-(layer, block, K/V) copies | "
             f"{st[kv]['p50_ms']:.1f} ms | {_ratio(st['ratio_kv_small_over_staged'])} "
             f"(seed 003 on Ascend: {_ratio(seed['ratio'])}) |"]
    paged = wp["restore_paged_one_launch_per_chunk"]["p50_ms"]
    rows = [("restore, as before: per-(chunk, layer, K/V) strided copies",
             "restore_before_strided_copies", "copies"),
            ("restore into the paged blocks, one `scatter_blocks` per chunk",
             "restore_paged_one_launch_per_chunk", "launches"),
            ("restore layer-wise, one `scatter_blocks` per (chunk, layer)",
             "restore_paged_layerwise_launch_per_chunk_layer", "launches"),
            ("store, one `gather_blocks` per chunk", "store_paged_gather_one_launch_per_chunk",
             "launches")]
    for label, key, unit in rows:
        v = wp[key]
        lines.append(f"| worker, {wp['chunks']} chunks ({wp['bytes'] / 2**20:.0f} MiB): {label} "
                     f"({v[unit]:,} {unit}) | {v['p50_ms']:.1f} ms | "
                     f"{_ratio(v['p50_ms'] / paged)} |")
    gpu = r["staging_gpu_triton"]
    gpu_line = (f"on {gpu['device_name']}: {_pct(gpu['fraction_of_peak'])} of peak"
                if isinstance(gpu, dict) else f"GPU: {gpu}")
    return _finish(doc, lines, KERNELS_COMMAND, (KERNELS,),
                   f"{c['dtype']}, {c['kv_heads']} kv heads x {c['head_dim']}, block "
                   f"{c['block_size']} tokens, {r['host']['threads']} torch thread(s), torch "
                   f"{r['host']['torch']}; {gpu_line}. ")


def _mask_table(doc: Doc) -> str:
    m = _load(doc.root, KERNELS)["mask_memory"]
    lines = ["| chunk C at cached D | valid mask [C, D+C] | full mask [C, max_len] | full / "
             "valid |", "| --- | --- | --- | --- |"]
    for row in m["per_chunk"]:
        lines.append(f"| C = {row['chunk']:,}, D = {row['cached']:,} | "
                     f"{row['valid_bytes_bool'] / 2**20:,.1f} MiB | "
                     f"{row['full_bytes_bool'] / 2**20:,.1f} MiB | "
                     f"{_ratio(row['full_over_valid'])} |")
    w = m["whole_prefill"]
    lines.append(f"| a whole {m['context']:,}-token prefill ({w['chunks']} chunks) | "
                 f"{w['valid_bytes_bool'] / 2**30:,.1f} GiB | {w['full_bytes_bool'] / 2**30:,.1f} "
                 f"GiB | {_ratio(w['full_over_valid'])} |")
    return _finish(doc, lines, KERNELS_COMMAND, (KERNELS,),
                   "Bool masks (fp16 additive ones are twice the bytes); the offset-causal "
                   f"Triton kernel allocates {m['offset_causal_triton_mask_bytes']} bytes. ")


def _reference_table(doc: Doc) -> str:
    """The quick run on the project's own engine, one row per run: each figure baseline ->
    agentserving, and agentserving's ratio."""
    reports = [_load(doc.root, n) for n in REFERENCE_RUNS]
    metrics = [("req/s", "req_per_s", "{:.2f}"), ("E2E P95", "e2e_p95_s", "{:.2f} s"),
               ("ITL P99", "itl_p99_s", "{:.3f} s")]
    lines = ["| run | " + " | ".join(f"{m}: baseline -> agentserving (ratio)" for m, _, _ in
                                     metrics) + " | hit / ideal | failed turns | targets met |",
             "| --- " * (len(metrics) + 4) + "|"]
    for i, r in enumerate(reports):
        base, cand = r["baseline"], "agentserving"
        b, c = r["configs"][base], r["configs"][cand]
        cells = [f"{fmt.format(b[k])} -> {fmt.format(c[k])} "
                 f"({_ratio(r['comparisons'][base]['ratios'][k])})" for _, k, fmt in metrics]
        met, total = _met(r)
        lines.append(f"| {i + 1} | " + " | ".join(cells) + f" | {_pct(c['hit_vs_ideal'])} | "
                     f"{b['turns_failed']} / {c['turns_failed']} | {met} of {total} |")
    lines += ["", _source_line(doc, REFERENCE_COMMAND,
                               list(zip(REFERENCE_RUNS, reports, strict=True)))]
    return "\n".join(lines)


def _proxy_cpu_table(doc: Doc) -> str:
    r = _load(doc.root, PROXY_CPU)
    lines = _md(["path", "proxy CPU per turn", "direct P50", "through the proxy P50",
                 "added P50"],
                [[name, *(_ms(v[k]) for k in ("proxy_cpu_ms_per_turn", "direct_p50_ms",
                                              "through_p50_ms", "added_p50_ms"))]
                 for name, v in r["paths"].items()])
    return _finish(doc, lines, PROXY_CPU_COMMAND, (PROXY_CPU,),
                   f"{r['turns']:,} turns per path, {r['prompt_tokens']:,}-token prompts. ")


def _err(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:+.1f}%"


def _sim_validation_table(doc: Doc) -> str:
    """Each real run and configuration: the host fitted from its engine metrics, and the
    simulator's throughput and E2E against the run's."""
    r = _load(doc.root, SIM_VALIDATION)
    lines = ["| run | config | host fitted from the run | req/s real / sim / err | E2E P95 real / "
             "sim / err | E2E P50 err | err on an idle host (req/s, P95) |", "| --- " * 7 + "|"]
    for v in r["validation"]:
        run = Path(v["real_report"]).name.removesuffix("-report.json")
        for name, row in v["configs"].items():
            env = ", ".join(f"{k.removeprefix('host_background_')} {val:g}"
                            for k, val in row["environment"].items()) or "idle"
            f, idle = row["fitted"], row["idle_host"]
            rps, p95 = f["req_per_s"], f["e2e_p95_s"]
            lines.append(f"| {run} | {name} | {env} | {rps['real']:.3f} / {rps['sim']:.3f} / "
                         f"**{_err(rps['error'])}** | {p95['real']:.3f} / {p95['sim']:.3f} / "
                         f"**{_err(p95['error'])}** | {_err(f['e2e_p50_s']['error'])} | "
                         f"{_err(idle['req_per_s']['error'])}, "
                         f"{_err(idle['e2e_p95_s']['error'])} |")
    a, note = r.get("validation_across_runs", {}), ""
    if a:
        means = "; ".join(f"{cfg} req/s {_err(m['req_per_s']['error_of_means'])}, E2E P95 "
                          f"{_err(m['e2e_p95_s']['error_of_means'])}"
                          for cfg, m in a.items() if isinstance(m, dict))
        note = (f"Runs with both configurations within 15 % on req/s and E2E P95: "
                f"{a['runs_within_15pct']} of {a['runs']}. The mean prediction against the mean "
                f"of the runs: {means}. ")
    return _finish(doc, lines, SIM_VALIDATION_COMMAND, (SIM_VALIDATION,), note)


def _sim_seed_table(doc: Doc) -> str:
    r = _load(doc.root, SIM_VALIDATION)["seed_003"]
    lines = ["| profile | req/s base -> agent | change (seed) | E2E P95 base -> agent | change "
             "(seed) | prefix hit (seed) | ITL P99 ratio (seed) | with conditional "
             "disaggregation: req/s, E2E P95 change, ITL P99 ratio |", "| --- " * 8 + "|"]
    for prof, v in r.items():
        b, a = v["sim"]["baseline"], v["sim"]["agentserving"]
        x, seed = v["sim_ratios"], v["seed_ratios"]
        c = v["conditional_disaggregation"]["sim_ratios"]
        lines.append(
            f"| {prof} | {b['req_per_s']:.2f} -> {a['req_per_s']:.2f} | "
            f"**{_err(x['req_per_s'] - 1)}** ({_err(seed['req_per_s'] - 1)}) | "
            f"{b['e2e_p95_s']:.0f} -> {a['e2e_p95_s']:.0f} s | **{_err(x['e2e_p95_s'] - 1)}** "
            f"({_err(seed['e2e_p95_s'] - 1)}) | {_pct(x['prefix_hit_rate'])} "
            f"({_pct(seed['prefix_hit_rate'])}) | {_ratio(x['itl_p99_s'])} "
            f"({_ratio(seed['itl_p99_s'])}) | {_err(c['req_per_s'] - 1)}, "
            f"{_err(c['e2e_p95_s'] - 1)}, {_ratio(c['itl_p99_s'])} |")
    n = next(iter(r.values()))
    return _finish(doc, lines, SIM_VALIDATION_COMMAND, (SIM_VALIDATION,),
                   f"{n['sessions']:,} sessions of the `agent` preset, Poisson {n['ips']:g} IPS, "
                   f"1P3D against 4 independent pods. ")


def _sim_scale_table(doc: Doc) -> str:
    rows = []
    for name in SIM_SCALE:
        r = _load(doc.root, name)["scale"]
        for row in r["rows"]:
            ops = row.get("index_chunk_ops")
            ops_cell = "–" if ops is None else f"{ops / 1e6:.2f} M ({ops / row['turns']:.0f})"
            queued = ", ".join("–" if q is None else f"{q:,g}"
                               for q in row["queued_turns_by_quarter"])
            rows.append([
                f"{row['pods']} ({row['topology']})", f"{row['sessions']:,}",
                f"{r['per_pod_ips']:g}", f"{row['turns']:,}",
                f"{row['cpu_s']:.1f} (+{row['workload_cpu_s']:.1f})",
                f"{row['total_wall_s']:.0f} s, {row['max_rss_mib'] / 1024:.1f} GiB",
                f"{row['lookups_per_sim_s']:.1f}", f"{row['lookup_chunks_mean']:.1f}",
                f"{row['lookup_us_mean']:.0f}", ops_cell, f"{row['route_prefix_efficiency']:.2f}",
                f"{row['hit_vs_ideal']:.2f}", f"{row['e2e_p50_s']:.1f} / {row['e2e_p95_s']:.1f} s",
                queued])
    lines = _md(["pods", "sessions", "load/pod", "turns", "CPU s sim (+ workload)",
                 "wall, workload included; peak RSS",
                 "lookups/sim-s", "chunks/lookup", "lookup µs", "index chunk ops (per turn)",
                 "route prefix eff.", "hit / ideal", "E2E P50 / P95", "queued turns by quarter"],
                rows)
    profile = _load(doc.root, SIM_SCALE[0])["scale"]["profile"]
    return _finish(doc, lines, SIM_SCALE_COMMAND, SIM_SCALE,
                   f"Profile {profile}. ")


def _headline(doc: Doc) -> str:
    return _comparison_table(doc, MAIN_RUNS, ["vllm-rr", "vllm-session", "vllm-precise"],
                             MAIN_COMMAND, short_ttft=False)


TABLES: dict[str, Callable[[Doc], str]] = {
    "main-job-headline": _headline,
    "main-job-ratios": lambda d: _comparison_table(d, MAIN_RUNS, None, MAIN_COMMAND),
    "main-job-absolute": lambda d: _absolute_table(d, MAIN_RUNS),
    "main-job-checks": lambda d: _checks_table(d, MAIN_RUNS),
    "main-job-by-source": lambda d: _by_source_table(d, MAIN_RUNS),
    "main-job-shadow": lambda d: _shadow_table(d, MAIN_RUNS),
    "main-job-kv-wait": lambda d: _kv_wait_table(d, MAIN_RUNS),
    "decode-longcap": lambda d: _comparison_table(d, DECODE_LONGCAP_RUNS, None,
                                                  DECODE_LONGCAP_COMMAND),
    "decode-longcap-wait": lambda d: _comparison_table(d, DECODE_WAIT_RUNS, None,
                                                       DECODE_WAIT_COMMAND),
    "decode-longcap-mooncake": lambda d: _absolute_table(d, DECODE_MOONCAKE_RUNS,
                                                         DECODE_MOONCAKE_COMMAND),
    "balanced-placement": lambda d: _comparison_table(d, BALANCED_RUNS, None,
                                                      BALANCED_COMMAND),
    "balanced-placement-mooncake": lambda d: _absolute_table(d, BALANCED_MOONCAKE_RUNS,
                                                             BALANCED_MOONCAKE_COMMAND),
    "admission-mooncake": lambda d: _absolute_table(d, ADMISSION_MOONCAKE_RUNS,
                                                    ADMISSION_MOONCAKE_COMMAND),
    "agent-mix-0.5": lambda d: _comparison_table(d, MIX_RUNS["0.5"], None, MIX_COMMAND["0.5"],
                                                 short_ttft=False),
    "agent-mix-0.25": lambda d: _comparison_table(d, MIX_RUNS["0.25"], None,
                                                  MIX_COMMAND["0.25"], short_ttft=False),
    "disk-tier": _disk_tier_table,
    "prefix-stability": _prefix_stability_table,
    "agent-pressure": _agent_pressure_table,
    "agent-pressure-prefetch": lambda d: _agent_pressure_table(
        d, AGENT_PRESSURE_PREFETCH, AGENT_PRESSURE_PREFETCH_COMMAND),
    "agent-pressure-hold": lambda d: _agent_pressure_table(
        d, AGENT_PRESSURE_HOLD, AGENT_PRESSURE_HOLD_COMMAND),
    "announced-turns": _announced_table,
    "tool-gap-disk": _tool_gap_disk_table,
    "kv-lifecycle": _kv_lifecycle_table,
    "pd-transfer": _pd_transfer_table,
    "layerwise-reload": _layerwise_reload_table,
    "proxy-replicas": _proxy_replicas_table,
    "control-plane-load": _control_plane_table,
    "proxy-overhead": _proxy_overhead_table,
    "concurrency": _concurrency_table,
    "soak": _soak_table,
    "soak-vllm": lambda d: _soak_table(d, SOAK_VLLM, SOAK_VLLM_COMMAND),
    "faults": _faults_table,
    "faults-vllm": lambda d: _faults_table(d, FAULTS_VLLM, FAULTS_VLLM_COMMAND),
    "prefill-sched": _prefill_sched_table,
    "prefill-sched-shadow": _prefill_shadow_table,
    "kernels": _kernels_table,
    "kernels-masks": _mask_table,
    "reference-quick-run": _reference_table,
    "proxy-cpu": _proxy_cpu_table,
    "sim-validation": _sim_validation_table,
    "sim-seed-003": _sim_seed_table,
    "sim-scale": _sim_scale_table,
}

def render(text: str, doc: Doc, tables: dict[str, Callable[[Doc], str]] = TABLES) -> str:
    """The page with every marked table rendered afresh; an unknown name is an error."""
    unknown = sorted(set(OPENING.findall(text)) - set(tables))
    if unknown:
        raise KeyError(f"no table named {', '.join(unknown)} (known: {', '.join(tables)})")
    return MARKER.sub(lambda m: m["open"] + tables[m["name"]](doc) + "\n" + m["close"], text)


def pages(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def stale(root: Path = REPO) -> list[str]:
    """Each table whose committed text differs from what its JSON renders, as `file: table`."""
    out = []
    for page in pages(root):
        text = page.read_text()
        doc = Doc(root, page.parent.relative_to(root))
        fresh = render(text, doc)
        if fresh == text:
            continue
        old = {m["name"]: m["body"] for m in MARKER.finditer(text)}
        new = {m["name"]: m["body"] for m in MARKER.finditer(fresh)}
        out += [f"{page.relative_to(root)}: {n}" for n in old if old[n] != new.get(n)]
    return out


def regenerate(root: Path = REPO) -> list[str]:
    """Rewrite every page whose tables are stale; the pages written."""
    written = []
    for page in pages(root):
        text = page.read_text()
        fresh = render(text, Doc(root, page.parent.relative_to(root)))
        if fresh != text:
            page.write_text(fresh)
            written.append(str(page.relative_to(root)))
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.docs_tables", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true",
                   help="change nothing; exit 1 naming every table that differs from its JSON")
    p.add_argument("--root", type=Path, default=REPO,
                   help="repository root holding README.md, docs/ and bench/results/published/")
    args = p.parse_args(argv)
    try:
        if args.check:
            bad = stale(args.root)
            for b in bad:
                print(f"stale table (run `make docs`): {b}", file=sys.stderr)
            return 1 if bad else 0
        for w in regenerate(args.root):
            print(f"rewrote {w}")
    except (KeyError, FileNotFoundError) as e:
        print(f"docs tables: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
