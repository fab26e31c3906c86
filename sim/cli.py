"""`agentserving sim`: simulate baseline vs agentserving on a workload; `sim calibrate`."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click

from agentserving.core.cli import option


def run_pair(trace_spec: str, profile_spec: str, topology: str, policy: str, shadow: bool,
             configs: list[str], rate: float | None, time_scale: float, limit: int | None,
             seed: int, sample_s: float, engine_scheduler: bool = False,
             env: dict[str, dict[str, float]] | None = None,
             proxy: dict[str, int] | None = None
             ) -> tuple[dict[str, Any], dict[str, Any], Any]:
    from agentserving.replay.loader import load_trace
    from agentserving.sim.cluster import SimConfig, simulate
    from agentserving.sim.profile import load_profile
    from agentserving.sim.validate import environment_fields
    from agentserving.sim.workload import compile_trace

    trace = load_trace(trace_spec, limit=limit)
    profile = load_profile(profile_spec)
    results = {}
    for name in configs:
        cfg = SimConfig(config=name, topology=topology, policy=policy, shadow=shadow,
                        rate=rate, time_scale=time_scale, seed=seed, sample_s=sample_s,
                        engine_scheduler=engine_scheduler,
                        **environment_fields((env or {}).get(name)), **(proxy or {}))
        results[name] = simulate(compile_trace(trace), profile, cfg)
    settings = {"trace": trace_spec, "profile": profile.name, "topology": topology,
                "policy": policy, "shadow": shadow, "rate": rate, "time_scale": time_scale,
                "limit": limit, "seed": seed, "engine_scheduler": engine_scheduler,
                "environment": env, **(proxy or {})}
    return results, settings, profile


@click.group("sim", invoke_without_command=True)
@option("--trace", "trace_spec", default="bundled:bench-small",
        help="Workload: bundled:NAME, a session trace, or a Mooncake trace.")
@option("--profile", "profile_spec", default="reference-cpu",
        help="Accelerator profile: a name in sim/profiles/ or a YAML path.")
@option("--topology", default="1P3D", help="xPyD or Nx1 (the baseline gets x+y pods).")
@option("--policy", default="longcap-dynamic", help="agentserving's prefill policy.")
@option("--shadow/--no-shadow", default=True, help="Wrap the policy in the ShadowScheduler.")
@option("--configs", default="baseline,agentserving", help="Configurations to simulate.")
@option("--rate", type=float, default=None, help="Sessions/s (Poisson) instead of trace times.")
@option("--time-scale", type=float, default=1.0, help="Multiply arrivals and tool gaps.")
@option("--limit", type=int, default=None, help="First N sessions only.")
@option("--seed", type=int, default=0)
@option("--sample-s", type=float, default=5.0, help="Time-series interval (sim seconds).")
@option("--sweep", default=None,
        help="Comma-separated IPS values: sweep load x --sweep-topologies instead of one run.")
@option("--sweep-topologies", default="1P3D", help="Topologies for --sweep.")
@option("--engine-scheduler/--pure-policies", default=False,
        help="Every pod runs the profile's engine scheduler (the reference engine's own FCFS, "
             "as `agentserving compare` runs it) instead of the prefill policies.")
@option("--validate", "validate_path", type=click.Path(exists=True, path_type=Path),
        default=None, help="A real bench report.json of the same workload: simulate its fleet "
             "(engine scheduler, its topology and rate, the host load measured from its "
             "engines' metrics) and report the errors vs it.")
@option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
        help="Output folder [default: runs/sim-<time>].")
@option("--local-prefill-tokens", type=click.IntRange(min=0), default=0,
        help="agentserving: the proxy's conditional disaggregation (a turn whose decode pod "
             "would compute at most this many prompt tokens runs whole there; the proxy's "
             "default is 2048); 0: every turn through the prefill pod. --validate takes the "
             "real run's.")
@option("--max-prefill-backlog", type=click.IntRange(min=0), default=0,
        help="agentserving: the proxy's prefill-queue rule (any turn prefills on a decode pod "
             "once every prefill pod has this many turns in flight); 0: no limit, the proxy's "
             "default. --validate takes the real run's.")
@option("--plots/--no-plots", default=True)
@click.pass_context
def command(ctx: click.Context, trace_spec: str, profile_spec: str, topology: str, policy: str,
            shadow: bool, configs: str, rate: float | None, time_scale: float,
            limit: int | None, seed: int, sample_s: float, sweep: str | None,
            sweep_topologies: str, engine_scheduler: bool, validate_path: Path | None,
            out: Path | None, local_prefill_tokens: int, max_prefill_backlog: int,
            plots: bool) -> None:
    """Simulate a cluster running the real routing/scheduling/index code; write report.json."""
    if ctx.invoked_subcommand is not None:
        return
    from agentserving.replay.report import print_table
    from agentserving.sim.report import draw, draw_sweep, write_run

    out = out or Path("runs") / time.strftime("sim-%Y%m%d-%H%M%S")
    proxy = {"local_prefill_tokens": local_prefill_tokens,
             "max_prefill_backlog": max_prefill_backlog}
    names = [c.strip() for c in configs.split(",") if c.strip()]
    if sweep:
        rows = []
        for topo in [t.strip() for t in sweep_topologies.split(",")]:
            for ips in [float(x) for x in sweep.split(",")]:
                results, _, _ = run_pair(trace_spec, profile_spec, topo, policy, shadow, names,
                                         ips, time_scale, limit, seed, sample_s,
                                         engine_scheduler, proxy=proxy)
                for name, r in results.items():
                    rows.append({"config": name, "topology": topo, "ips": ips,
                                 **{k: r.summary.get(k) for k in
                                    ("req_per_s", "e2e_p95_s", "prefix_hit_rate",
                                     "itl_p99_s", "ttft_p95_s")}})
                    click.echo(json.dumps(rows[-1]))
        out.mkdir(parents=True, exist_ok=True)
        (out / "sweep.json").write_text(json.dumps(rows, indent=2) + "\n")
        if plots:
            click.echo(f"plot:   {draw_sweep(out / 'plots' / 'sweep.png', rows)}")
        click.echo(f"sweep:  {out / 'sweep.json'}")
        return
    check = None
    env = None
    if validate_path is not None:
        from agentserving.replay.loader import load_trace
        from agentserving.sim.profile import load_profile
        from agentserving.sim.validate import validate
        from agentserving.sim.workload import compile_trace

        real = json.loads(validate_path.read_text())
        rs = real.get("settings", {})
        topology = f"{rs.get('prefill', 1)}P{rs.get('decode', 2)}D"
        rate, engine_scheduler = rs.get("rate"), True
        trace_spec = real.get("workload", {}).get("spec", trace_spec)
        check = validate(real, compile_trace(load_trace(trace_spec, limit=limit)),
                         load_profile(profile_spec))
        env = {k: row["environment"] for k, row in check["configs"].items()}
        proxy = check["proxy"]
    results, settings, profile = run_pair(trace_spec, profile_spec, topology, policy, shadow,
                                          names, rate, time_scale, limit, seed, sample_s,
                                          engine_scheduler, env, proxy)
    extra: dict[str, Any] = {"settings": settings, "simulated": True,
                             "profile": profile.model_dump(mode="json", exclude={"measured"})}
    if check is not None:
        extra["validation"] = {"real_report": str(validate_path), **check}
    report = write_run(out, results, **extra)
    if "baseline" in results and "agentserving" in results:
        print_table(report, title=f"simulated {trace_spec} on {profile.name}: baseline vs "
                                  f"agentserving {topology}")
    if check is not None:
        for cfgname, row in check["configs"].items():
            click.echo(f"validation {cfgname}: host environment measured from the run "
                       f"{row['environment']}")
            for key in ("req_per_s", "e2e_p95_s", "e2e_p50_s", "ttft_p50_s"):
                fit, idle = row["fitted"][key], row["idle_host"][key]
                if fit["error"] is None:
                    continue
                click.echo(f"validation {cfgname} {key}: real {fit['real']:.3f} sim "
                           f"{fit['sim']:.3f} error {100 * fit['error']:+.1f}% "
                           f"(idle host: {100 * idle['error']:+.1f}%)")
    if plots:
        for path in draw(out, results, report):
            click.echo(f"plot:   {path}")
    click.echo(f"report: {out / 'report.json'}")


@command.command("calibrate")
@option("--model", default="tiny", help="Reference-engine model to measure.")
@option("--from-run", type=click.Path(exists=True, path_type=Path), default=None,
        help="A real bench report.json: take the host's cores from it and record its "
             "worker figures beside the measurements.")
@option("--name", default="reference-cpu")
@option("--full/--quick", default=False, help="More calibration points.")
@option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
        help="Profile path [default: sim/profiles/NAME.yaml].")
def calibrate_command(model: str, from_run: Path | None, name: str, full: bool,
                      out: Path | None) -> None:
    """Measure the reference engine briefly, in-process, and write a profile."""
    from agentserving.sim.calibrate import build_profile, measure
    from agentserving.sim.calibrate import from_run as fit_run
    from agentserving.sim.profile import PROFILE_DIR, write_profile

    m = measure(model, quick=not full)
    prof = build_profile(m, fit_run(from_run) if from_run else None, name=name)
    path = write_profile(prof, out or PROFILE_DIR / f"{name}.yaml")
    click.echo(json.dumps({"prefill": prof.prefill.model_dump(),
                           "decode": prof.decode.model_dump(),
                           "bandwidth": prof.bandwidth.model_dump()}, indent=1))
    click.echo(f"profile: {path}")


@command.command("check-steps")
@click.argument("step_log_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@option("--profile", "profile_spec", default="reference-cpu",
        help="Accelerator profile: a name in sim/profiles/ or a YAML path.")
@option("--fold-into", type=click.Path(dir_okay=False, path_type=Path), default=None,
        help="Write the per-role CPU / price ratios into this profile YAML as its "
             "step_cost_factor (the profile read is --profile's, without its old factors).")
def check_steps_command(step_log_dir: Path, profile_spec: str, fold_into: Path | None
                        ) -> None:
    """Price the steps real engines logged (worker --step-log-dir DIR) with a profile: per
    engine and step kind, the profile's seconds against the loop's CPU and wall seconds, and
    per pod role the factor that would make them agree."""
    from agentserving.sim.profile import load_profile, write_profile
    from agentserving.sim.steps import load_step_logs, price_steps, role_factors

    profile = load_profile(profile_spec)
    logs = load_step_logs(step_log_dir)
    if not logs:
        raise click.UsageError(f"no *.jsonl step logs in {step_log_dir}")
    out: dict[str, Any] = {name: price_steps(profile, steps) for name, steps in logs.items()}
    out["all"] = price_steps(profile, [s for steps in logs.values() for s in steps])
    out["step_cost_factor"] = role_factors(profile, logs)
    click.echo(json.dumps(out, indent=1))
    if fold_into is not None:
        write_profile(profile.model_copy(update={"step_cost_factor": out["step_cost_factor"]}),
                      fold_into)
        click.echo(f"profile: {fold_into}")
