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
    axes[0].set_title("KV tier occupancy (all pods)")
    axes[0].set_ylabel("GiB")
    axes[1].set_title("KV transfer volume (cumulative)")
    axes[1].set_ylabel("GiB")
    for ax in axes:
        ax.set_xlabel("simulated seconds")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / "plots" / "tiers.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
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
    axes[0].set_title("request throughput")
    axes[0].set_ylabel("turns/s")
    axes[1].set_title("E2E P95")
    axes[1].set_ylabel("seconds")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("offered load (sessions/s, IPS)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

