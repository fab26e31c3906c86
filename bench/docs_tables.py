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
MAIN_COMMAND = "make run"  # agentserving compare, its defaults
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
KV_LIFECYCLE = "kv-lifecycle.json"
KV_LIFECYCLE_COMMAND = "python -m bench kv_lifecycle"
PREFIX_STABILITY = "prefix-stability.json"
PREFIX_STABILITY_COMMAND = "python -m bench prefix_stability"


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


def _absolute_table(doc: Doc, names: tuple[str, ...]) -> str:
    reports = [_load(doc.root, n) for n in names]
    cols = [("req/s", "req_per_s", lambda x: f"{x:.2f}"), ("E2E P95", "e2e_p95_s", _s),
            ("short TTFT P50", "ttft_p50_short_s", _s), ("short TTFT P85", "ttft_p85_short_s", _s),
            ("prefix hit", "prefix_hit_rate", _pct), ("failed turns", "turns_failed", str),
            ("forced mismatches", "forced_mismatches", str)]
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
            oks.append("–" if c is None else ("yes" if c["ok"] else "**no**"))
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
    lines = ["| run | agentserving KV wait P50 | forward P50 | share (target ≤ 10 %) | "
             "disk read (O_DIRECT) | per 2 MiB chunk P50 |", "| --- " * 6 + "|"]
    for i, r in enumerate(reports):
        st = r["configs"]["agentserving"]["steps"]
        disk = r["settings"]["disk_tier"]["reads"]
        lines.append(f"| {i + 1} | {1000 * st['kv_wait_exposed_p50_s']:.1f} ms | "
                     f"{1000 * st['forward_p50_s']:.0f} ms | {_pct(st['kv_wait_share_p50'])} | "
                     f"{disk['read_gbps']:.2f} GB/s | {disk['read_p50_ms']:.1f} ms |")
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
    host = r.get("host", {})
    lines += ["", f"Model: {r.get('model', '?')}. Command: `{DISK_TIER_COMMAND}` "
                  f"({host.get('machine', '?')}, Python {host.get('python', '?')}, torch "
                  f"{host.get('torch', '?')}); JSON: {doc.link(DISK_TIER)}."]
    return "\n".join(lines)


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
        cand, ablation = r["configs"]["agentserving"], r["configs"]["agentserving-noprefetch"]
        ratio = cand["ttft_p50_after_gap_s"] / ablation["ttft_p50_after_gap_s"]
        lines.append(f"| {scale} | {a['announced']} | {a['arrived']} | "
                     f"{a['fired_by_window']} / {a['fired_idle']} | "
                     f"{a['prefetched_before_arrival']} | {read} | "
                     f"{_s(cand['ttft_p50_after_gap_s'])} "
                     f"({cand['after_gap_turns']}) | {_s(ablation['ttft_p50_after_gap_s'])} "
                     f"({_ratio(ratio)}) |")
    lines += ["", _source_line(doc, ANNOUNCED_COMMAND, reports)]
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


def _prefix_stability_table(doc: Doc) -> str:
    r = _load(doc.root, PREFIX_STABILITY)
    labels = {"template as is": "the template as is (the call in `tool_calls`)",
              "tool calls in the text": "tool calls written into the text (the importer's choice)"}
    lines = ["| replies sent back | prefix-stable turns | breaks |", "| --- | --- | --- |"]
    for mode, v in r["modes"].items():
        breaks = ", ".join(f"{why}: {n:,}" for why, n in v["breaks"].items()) or "none"
        lines.append(f"| {labels.get(mode, mode)} | {v['stable']:,} of {v['turns']:,} "
                     f"({_pct(v['stable_share'])}) | {breaks} |")
    lines += ["", f"Command: `{PREFIX_STABILITY_COMMAND}` ({r['sessions']} sessions of "
                  f"`{Path(r['src']).name}`, model {r['model']}, template {r['template']}, "
                  f"{r['wall_s']:.0f} s); JSON: {doc.link(PREFIX_STABILITY)}."]
    return "\n".join(lines)


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
    "agent-mix-0.5": lambda d: _comparison_table(d, MIX_RUNS["0.5"], None, MIX_COMMAND["0.5"],
                                                 short_ttft=False),
    "agent-mix-0.25": lambda d: _comparison_table(d, MIX_RUNS["0.25"], None,
                                                  MIX_COMMAND["0.25"], short_ttft=False),
    "disk-tier": _disk_tier_table,
    "prefix-stability": _prefix_stability_table,
    "announced-turns": _announced_table,
    "kv-lifecycle": _kv_lifecycle_table,
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
