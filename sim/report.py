"""What a simulation writes: report.json in `agentserving compare`'s shape (built with
``agentserving.replay.report.build_report``), turn records, the tier time series, and plots
(the bench's own plots, plus occupancy and transfer volume over time, plus sweep curves)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agentserving.replay.report import build_report, draw_plots
from agentserving.sim.cluster import SimResult


def write_run(out: Path, results: dict[str, SimResult], **extra: Any) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    report = build_report({k: r.summary for k, r in results.items()}, **extra)
    report["timeseries"] = {k: r.timeseries for k, r in results.items()}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    for name, r in results.items():
        (out / name).mkdir(exist_ok=True)
        with open(out / name / "turns.jsonl", "w") as f:
            for rec in r.records:
                f.write(json.dumps(rec) + "\n")
        (out / name / "summary.json").write_text(json.dumps(r.summary, indent=2) + "\n")
    return report


def draw(out: Path, results: dict[str, SimResult], report: dict[str, Any]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = draw_plots(out / "plots", {k: r.records for k, r in results.items()}, report)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
    for name, r in results.items():
        ts = r.timeseries
        for key in (k for k in ts if k.startswith("occupancy_bytes_")):
            if any(ts[key]):
                axes[0].plot(ts["t"], [v / 2**30 for v in ts[key]],
                             label=f"{name}: {key.removeprefix('occupancy_bytes_')}")
        for key in (k for k in ts if k.startswith("moved_bytes_")):
            if any(ts[key]):
                axes[1].plot(ts["t"], [v / 2**30 for v in ts[key]],
                             label=f"{name}: {key.removeprefix('moved_bytes_')}")
    path = _save_panels(fig, axes, [("KV tier occupancy (all pods)", "GiB"),
                                    ("KV transfer volume (cumulative)", "GiB")],
                        "simulated seconds", out / "plots" / "tiers.png")
    return [*files, path]


def draw_sweep(path: Path, rows: list[dict[str, Any]]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    series = sorted({(r["config"], r["topology"]) for r in rows})
    for config, topo in series:
        pts = sorted((r for r in rows if r["config"] == config and r["topology"] == topo),
                     key=lambda r: r["ips"])
        label = f"{config} {topo}"
        axes[0].plot([p["ips"] for p in pts], [p["req_per_s"] for p in pts], "o-", label=label)
        axes[1].plot([p["ips"] for p in pts], [p["e2e_p95_s"] for p in pts], "o-", label=label)
    axes[1].set_yscale("log")
    return _save_panels(fig, axes, [("request throughput", "turns/s"), ("E2E P95", "seconds")],
                        "offered load (sessions/s, IPS)", path)


def _save_panels(fig: Any, axes: Any, titles: list[tuple[str, str]], xlabel: str,
                 path: Path) -> Path:
    """Title and label each panel ((title, y label) each, one x label), grid and legend them
    alike, and write the figure: the report's plots look as one set."""
    import matplotlib.pyplot as plt

    for ax, (title, ylabel) in zip(axes, titles, strict=True):
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

