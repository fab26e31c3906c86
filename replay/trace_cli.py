"""`agentserving trace`: generate, convert and inspect replay traces."""

from __future__ import annotations

import json
from pathlib import Path

import click

from agentserving.core.cli import option
from agentserving.core.hashing import DEFAULT_CHUNK_SIZE
from agentserving.replay.mooncake import MooncakeOptions


@click.group("trace")
def command() -> None:
    """Generate synthetic agent sessions, convert Mooncake traces, print trace statistics."""


@command.command("generate")
@option("--preset", type=click.Choice(["bench-agent", "bench-small", "agent"]),
        default="bench-small",
        help="Distribution preset (docs/replay.md lists their numbers and sources).")
@option("--sessions", type=click.IntRange(min=1), default=None,
        help="Number of root sessions [default: the preset's].")
@option("--seed", type=int, default=None, help="Seed [default: the preset's].")
@option("--arrival-rate", type=click.FloatRange(min=0, min_open=True), default=None,
        help="Sessions/s written as start_s [default: the preset's].")
@option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True,
        help="Where to write the JSONL trace.")
def generate_cmd(preset: str, sessions: int | None, seed: int | None,
                 arrival_rate: float | None, out: Path) -> None:
    """Write a seeded synthetic agent-session trace (same arguments, same bytes)."""
    from agentserving.replay.synthetic import generate_preset
    from agentserving.replay.trace import write_trace

    overrides = {k: v for k, v in (("sessions", sessions), ("seed", seed),
                                   ("arrival_rate", arrival_rate)) if v is not None}
    trace = generate_preset(preset, **overrides)
    write_trace(trace, out)
    click.echo(f"{out}: {len(trace.sessions)} sessions, {trace.num_turns} turns")


@command.command("mooncake")
@option("--input", "path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
        default=Path("../shared/data/mooncake/conversation_trace.jsonl"),
        help="A Mooncake trace (hash_ids of 512-token blocks).")
@option("--max-requests", type=click.IntRange(min=1), default=None,
        help="Only the first N requests (in time).")
@option("--block-tokens", type=click.IntRange(1, 512), default=512,
        help="Tokens per hash block; below 512 scales every prompt down.")
@option("--max-output", type=click.IntRange(min=1), default=None, help="Cap every output.")
@option("--max-input", type=click.IntRange(min=1), default=None,
        help="Drop requests with more input tokens than this.")
@option("--min-shared-blocks", type=click.IntRange(min=1), default=2,
        help="Leading blocks two requests must share to be one conversation.")
@option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True)
def mooncake_cmd(path: Path, max_requests: int | None, block_tokens: int,
                 max_output: int | None, max_input: int | None, min_shared_blocks: int,
                 out: Path) -> None:
    """Convert a Mooncake trace into agent sessions (grouping rule: docs/replay.md)."""
    from agentserving.replay.mooncake import read_mooncake
    from agentserving.replay.trace import write_trace

    trace = read_mooncake(path, MooncakeOptions(
        max_requests=max_requests, block_tokens=block_tokens, max_output_tokens=max_output,
        max_input_tokens=max_input, min_shared_blocks=min_shared_blocks))
    write_trace(trace, out)
    click.echo(f"{out}: {len(trace.sessions)} sessions, {trace.num_turns} turns")


@command.command("stats")
@click.argument("trace_spec")
@option("--chunk-size", type=click.IntRange(min=1), default=DEFAULT_CHUNK_SIZE,
        help="KV chunk size for the ideal hit rate.")
@option("--limit", type=click.IntRange(min=1), default=None, help="First N sessions only.")
@option("--mooncake-block-tokens", type=click.IntRange(1, 512), default=512)
def stats_cmd(trace_spec: str, chunk_size: int, limit: int | None,
              mooncake_block_tokens: int) -> None:
    """Print a trace's shape (sessions, turns, tokens, gaps) and its ideal hit rate."""
    from agentserving.replay.loader import load_trace
    from agentserving.replay.stats import trace_stats

    trace = load_trace(trace_spec, limit=limit,
                       mooncake=MooncakeOptions(block_tokens=mooncake_block_tokens))
    click.echo(json.dumps(trace_stats(trace, chunk_size=chunk_size), indent=2))
