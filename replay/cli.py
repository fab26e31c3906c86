"""`agentserving replay`: replay a multi-turn trace against a server, teacher-forced."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from agentserving.core.cli import option
from agentserving.core.hashing import DEFAULT_CHUNK_SIZE
from agentserving.replay.mooncake import MooncakeOptions
from agentserving.replay.mooncake_cli import mooncake_options


def default_run_dir(kind: str) -> Path:
    return Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{kind}"


@click.command("replay")
@option("--trace", "trace_spec", required=True,
        help="A session trace (docs/replay.md), a Mooncake trace, or bundled:NAME "
             "(bundled:agent-mix, bundled:bench-agent, bundled:bench-small, bundled:agent).")
@option("--target", required=True, help="Base URL of the proxy or worker, e.g. "
        "http://127.0.0.1:8080.")
@option("--rate", type=click.FloatRange(min=0, min_open=True), default=None,
        help="Sessions per second, Poisson (seeded by --seed). Default: the trace's start times.")
@option("--timestamps", is_flag=True, default=False,
        help="Start sessions at the trace's own start times (the default without --rate).")
@option("--limit", type=click.IntRange(min=1), default=None,
        help="Replay only the first N sessions (tasks), with their branches.")
@option("--time-scale", type=click.FloatRange(min=0), default=1.0,
        help="Multiply every time in the trace (arrivals, turn timestamps, tool gaps) by X.")
@option("--tool-gap-scale", type=click.FloatRange(min=0), default=1.0,
        help="Multiply the tool gaps by X on top of --time-scale (a trace compressed at "
             "import, replayed with its tools as long as they ran).")
@option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
        help="Output folder for turns.jsonl and summary.json [default: runs/<time>-replay].")
@option("--seed", type=int, default=0, help="Seed of the Poisson arrivals.")
@option("--model", default=None, help="Model name to send [default: the server's first].")
@option("--vocab-size", type=click.IntRange(min=17), default=None,
        help="Token ids are drawn below this [default: the trace header's].")
@option("--max-active-sessions", type=click.IntRange(min=1), default=None,
        help="At most N sessions in flight (an agent pool); default unlimited.")
@option("--request-timeout", "request_timeout_s", type=click.FloatRange(min=0.1),
        default=600.0, help="Seconds before a turn counts as failed.")
@option("--chunk-size", type=click.IntRange(min=1), default=DEFAULT_CHUNK_SIZE,
        help="KV chunk size, for the trace's ideal hit rate.")
@mooncake_options(block_tokens=512, max_output=None)
@option("--api-key", default=None, help="Sent as 'Authorization: Bearer KEY' (proxy with keys).")
@option("--progress/--no-progress", default=True, help="Show a progress bar.")
def command(trace_spec: str, target: str, rate: float | None, timestamps: bool,
            limit: int | None, time_scale: float, tool_gap_scale: float,
            out_dir: Path | None, seed: int,
            model: str | None, vocab_size: int | None, max_active_sessions: int | None,
            request_timeout_s: float, chunk_size: int, mooncake: MooncakeOptions,
            api_key: str | None, progress: bool) -> None:
    """Replay a multi-turn agent trace against TARGET with teacher forcing.

    Every turn is sent as token ids to /v1/completions (streaming) with the trace's output as
    forced_output_token_ids, so every run sends identical tokens; a session's next turn starts
    when its previous one finished plus the tool gap. Writes OUT/turns.jsonl (one record per
    turn: TTFT, inter-token latencies, E2E, prompt and cached tokens, routing, errors) and
    OUT/summary.json (the metrics, and the trace's ideal hit rate).
    """
    from agentserving.replay.client import Replayer, ReplayOptions
    from agentserving.replay.loader import load_trace

    if rate is not None and timestamps:
        raise click.UsageError("--rate and --timestamps exclude each other")
    trace = load_trace(trace_spec, limit=limit, mooncake=mooncake)
    out_dir = out_dir or default_run_dir("replay")
    opts = ReplayOptions(target=target, model=model, rate=rate, time_scale=time_scale,
                         tool_gap_scale=tool_gap_scale,
                         seed=seed, vocab_size=vocab_size,
                         max_active_sessions=max_active_sessions,
                         request_timeout_s=request_timeout_s, chunk_size=chunk_size,
                         progress=progress,
                         headers={"authorization": f"Bearer {api_key}"} if api_key else {})
    import asyncio

    result = asyncio.run(Replayer(trace, opts, out_dir=out_dir).run())
    s = result.summary
    click.echo(json.dumps({k: s[k] for k in (
        "success_rate", "turns_completed", "turns_planned", "req_per_s", "tok_per_s",
        "prefix_hit_rate", "ideal_hit_rate", "e2e_p95_s", "ttft_p50_s", "itl_p99_s")},
        indent=2))
    click.echo(f"records: {out_dir / 'turns.jsonl'}\nsummary: {out_dir / 'summary.json'}")
    if s["turns_failed"] or s["turns_not_sent"]:
        click.echo(f"{s['turns_failed']} turns failed, {s['turns_not_sent']} not sent: "
                   f"{s['errors']}", err=True)
        sys.exit(1)
