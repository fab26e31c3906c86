"""`agentserving report DIR`: print a run's table and redraw its plots."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("report")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
def command(run_dir: Path) -> None:
    """Redraw RUN_DIR's PNG plots (latency CDFs, throughput, hit rate over time, ratios).

    RUN_DIR is a folder written by `agentserving compare` (report.json plus one sub-folder of
    turn records per configuration) or by `agentserving replay --out` (turns.jsonl and
    summary.json).
    """
    from agentserving.replay.report import print_table, redraw

    try:
        report, files = redraw(run_dir)
    except FileNotFoundError as exc:
        raise click.ClickException(str(exc)) from exc
    if len(report["configs"]) >= 2 and "baseline" in report["configs"]:
        print_table(report)
    for path in files:
        click.echo(f"plot: {path}")
