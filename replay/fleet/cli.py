"""`agentserving up`: the whole system as real processes on loopback, until Ctrl-C."""

from __future__ import annotations

import signal
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from agentserving.core.cli import option


@click.command("up")
@option("--prefill", type=click.IntRange(min=0), default=1,
        help="Prefill workers (they also decode when --decode is 0).")
@option("--decode", type=click.IntRange(min=0), default=1, help="Decode workers.")
@option("--kvindex", default="memory",
        help="The kvindex store: 'memory' or a Redis URL (redis://host:6379/0).")
@option("--model", default="tiny", help="Model every worker serves.")
@option("--engine", type=click.Choice(["reference", "vllm"]), default="reference",
        help="The workers' engine: the project's reference engine, or vLLM with LMCache "
        "(scripts/vllm-env.sh installs it; with both pools KV servers carry P/D).")
@option("--config", "config", type=click.Choice(["agentserving", "llmd"]),
        default="agentserving", help="What to deploy, as `agentserving compare` names it: "
        "agentserving, or (--engine vllm) llmd, llm-d's tiered prefix cache: --prefill plus "
        "--decode pods, each prefilling and decoding with LMCache's DRAM tier (no disk tier: "
        "--disk-cache-gib is not used), behind llm-d's endpoint picker.")
@option("--routing", type=click.Choice(["kv-aware", "llm-d", "session", "round-robin"]),
        default=None, help="The proxy's routing policy [default: the configuration's: "
        "kv-aware, llm-d for llmd].")
@option("--cpu-cache-gib", type=click.FloatRange(min=0, min_open=True), default=2.0,
        help="Each worker's CPU DRAM KV tier.")
@option("--disk-cache-gib", type=click.FloatRange(min=0), default=4.0,
        help="Each worker's local-disk KV tier (0: none), under RUN_DIR/disk/.")
@option("--disk-io", type=click.Choice(["buffered", "direct"]), default="buffered",
        help="The disk tier's I/O (each worker's --disk-io): direct reads past the page "
             "cache (O_DIRECT), as an SSD costs once the working set outgrows DRAM.")
@option("--kv-layerwise-load/--no-kv-layerwise-load", default=None,
        help="Each worker copies a reused prefix into its KV blocks layer by layer while the "
        "forward pass runs (each worker's --kv-layerwise-load); off: all of it before "
        "[default: the configuration's: on, off for llmd].")
@option("--kv-transfer", type=click.Choice(["p2p", "server"]), default="p2p",
        help="vLLM P/D: p2p gives each vLLM worker its own KV server and a decode pod reads "
        "the prefill pod's chunks from it into its DRAM tier; server runs one central KV "
        "server all pods write to (`agentserving kvserver` either way).")
@option("--kv-transfer-gib", type=click.FloatRange(min=0, min_open=True), default=2.0,
        help="Bytes of KV each KV server keeps (least recently used goes first).")
@option("--proxy-port", type=click.IntRange(0, 65535), default=8080,
        help="The proxy's port (0: any free port).")
@option("--run-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
        help="Logs and fleet.json go here [default: runs/<time>-up].")
@option("--worker-arg", "worker_args", multiple=True,
        help="Extra flag passed to every worker (repeatable), e.g. --worker-arg=--torch-threads=1.")
@option("--startup-timeout", "startup_timeout_s", type=click.FloatRange(min=1), default=180.0,
        help="Seconds a worker may take to become healthy.")
def command(prefill: int, decode: int, kvindex: str, model: str, engine: str, config: str,
            routing: str | None, cpu_cache_gib: float, disk_cache_gib: float, disk_io: str,
            kv_layerwise_load: bool | None, kv_transfer: str, kv_transfer_gib: float,
            proxy_port: int, run_dir: Path | None,
            worker_args: tuple[str, ...], startup_timeout_s: float) -> None:
    """Start kvindex, workers and proxy on loopback; stop them all on Ctrl-C or SIGTERM.

    The fleet is the main job's agentserving configuration (`agentserving compare`'s: the
    same worker flags, prefill scheduling and proxy settings) at these sizes. Each process
    runs in its own process group, logging to RUN_DIR/logs/<name>.log; the endpoints are
    printed and written to RUN_DIR/fleet.json. With --prefill 0 --decode 0 only the kvindex
    runs; decode workers without a prefill worker are refused. Point a client at the proxy,
    e.g. `agentserving replay --trace bundled:bench-small --target http://127.0.0.1:8080`.
    """
    from agentserving.replay.configs import topology_error
    from agentserving.replay.fleet.process import FleetError
    from agentserving.replay.fleet.supervisor import Fleet
    from agentserving.replay.fleet.topology import build

    if why := topology_error(prefill, decode):
        raise click.BadParameter(why, param_hint="--prefill / --decode")
    if config != "agentserving" and engine != "vllm":
        raise click.BadParameter(f"{config} runs on --engine vllm", param_hint="--config")
    run_dir = run_dir or Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-up"
    chosen = {k: v for k, v in (("routing", routing), ("kv_layerwise_load", kv_layerwise_load))
              if v is not None}
    spec = up_spec(prefill=prefill, decode=decode, engine=engine, model=model,
                   cpu_cache_gib=cpu_cache_gib, disk_cache_gib=disk_cache_gib, disk_io=disk_io,
                   worker_args=list(worker_args), startup_timeout_s=startup_timeout_s,
                   config=config, kvindex=kvindex, kv_transfer=kv_transfer,
                   kv_transfer_gib=kv_transfer_gib, proxy_port=proxy_port, **chosen)
    fleet = Fleet(build(spec, run_dir), run_dir, on_event=lambda m: click.echo(f"[up] {m}"))
    # The handler only records the signal: it runs on the main thread between bytecodes, so
    # anything that takes a lock (Event.set, a buffered write) can deadlock with the very code
    # it interrupted -- two SIGTERMs in a row hung `up` inside Event.wait.
    received: list[int] = []

    def _on_signal(signum: int, _frame: object) -> None:
        received.append(signum)

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    try:
        fleet.start()
    except FleetError as exc:
        click.echo(f"[up] {exc}", err=True)
        sys.exit(1)
    click.echo(f"[up] ready: proxy {fleet.url('proxy') or '-'}  kvindex {fleet.url('kvindex')}")
    click.echo(f"[up] logs {fleet.log_dir}; endpoints {run_dir / 'fleet.json'}; Ctrl-C stops")
    code = 0
    try:
        while not received:
            time.sleep(0.2)
            if fleet.died:
                name, rc = fleet.died[0]
                click.echo(f"[up] {name} exited with {rc}: stopping the fleet", err=True)
                code = 1
                break
    finally:
        if received:
            click.echo(f"[up] {signal.Signals(received[0]).name}: stopping")
        fleet.stop()
    sys.exit(code)


def up_spec(*, prefill: int, decode: int, engine: str, model: str, cpu_cache_gib: float,
            disk_cache_gib: float, disk_io: str, worker_args: list[str],
            startup_timeout_s: float, config: str = "agentserving", **fleet: Any) -> Any:
    """What `agentserving up` starts: ``compare``'s ``config`` configuration at these sizes
    (one place for its worker flags, prefill scheduling and proxy settings), with the
    choices only a standing fleet has (``fleet``: kvindex store, routing, KV transfer, proxy
    port, layer-wise load) set on it. llmd's pods both prefill and decode: ``prefill +
    decode`` of them."""
    from agentserving.replay.configs import CONFIGS, FleetSizes, fleet_spec

    sizes = FleetSizes(engine=engine, prefill=prefill, decode=decode, model=model,
                       cpu_cache_gib=cpu_cache_gib, disk_cache_gib=disk_cache_gib,
                       disk_io=disk_io, worker_args=worker_args,
                       startup_timeout_s=startup_timeout_s)
    return replace(fleet_spec(CONFIGS[config], sizes), **fleet)
