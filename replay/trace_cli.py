"""`agentserving trace`: generate, import and inspect replay traces."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from agentserving.core.cli import option, settings_option
from agentserving.core.hashing import DEFAULT_CHUNK_SIZE
from agentserving.replay.importers.agent_mix import MixOptions
from agentserving.replay.importers.agent_pressure import PressureOptions
from agentserving.replay.mooncake import MooncakeOptions

DATA = Path("../shared/data")
MODEL_HELP = ("Serving model whose tokenizer and chat template count the tokens: 'smollm2' "
              "(SmolLM2-135M-Instruct's BPE and ChatML), 'tiny' (bytes) or a local model "
              "folder.")


@click.group("trace")
def command() -> None:
    """Generate synthetic agent sessions, import real traces (Mooncake, mini-swe-agent, MTRAG,
    the agent mix), print trace statistics."""


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


# ------------------------------------------------------------------------ real workloads


def _tokenizer(model: str) -> Any:
    from agentserving.engine.model.tokenizer import ModelNotAvailable, load_tokenizer

    try:
        return load_tokenizer(model)
    except ModelNotAvailable as exc:
        raise click.ClickException(str(exc)) from exc


def _scaling_options(token: float, output: float, time: float, time_help: str,
                     max_gap: float | None) -> Callable[[Any], Any]:
    """The sizing flags the importers share, with each importer's defaults."""
    from agentserving.replay.importers.scaling import MAIN_JOB_CONTEXT

    positive = click.FloatRange(min=0, min_open=True)
    flags = [
        option("--model", default="smollm2", help=MODEL_HELP),
        option("--token-scale", type=positive, default=token,
               help="Multiplies every input part's length (rounded, at least 1)."),
        option("--output-scale", type=positive, default=output,
               help="Multiplies every output's length (rounded, at least 1)."),
        option("--time-scale", type=positive, default=time, help=time_help),
        option("--max-gap", type=click.FloatRange(min=0), default=max_gap,
               help="Cap on every scaled pause between turns, seconds (none if unset)."),
        option("--max-context", type=click.IntRange(min=1), default=MAIN_JOB_CONTEXT,
               help="Cut a session before its first turn whose scaled prompt + output exceeds "
                    "this many tokens (a session whose first turn does not fit is dropped); "
                    "the default is the main job's per-pod vLLM context."),
        option("--max-turns", type=click.IntRange(min=1), default=None,
               help="Keep each session's first N turns."),
        option("--limit", type=click.IntRange(min=1), default=None,
               help="Only the first N sessions of the source."),
        option("--real-sizes", is_flag=True,
               help="Real sizes and times: every scale 1, no context cap, no gap cap."),
        option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True,
               help="Where to write the JSONL trace."),
    ]

    def decorate(fn: Any) -> Any:
        for flag in reversed(flags):
            fn = flag(fn)
        return fn

    return decorate


def _scaling(token_scale: float, output_scale: float, time_scale: float,
             max_gap: float | None, max_context: int, max_turns: int | None,
             real_sizes: bool) -> Any:
    from agentserving.replay.importers.scaling import Scaling

    scaling = Scaling(token_scale=token_scale, output_scale=output_scale,
                      time_scale=time_scale, max_context=max_context, max_turns=max_turns,
                      max_gap_s=max_gap)
    return scaling.real() if real_sizes else scaling


def _import(build: Callable[[], Any], out: Path) -> None:
    """Run an importer and write its trace; a malformed source is a clean error."""
    from agentserving.replay.trace import TraceFormatError, write_trace

    try:
        trace = build()
    except (TraceFormatError, FileNotFoundError) as exc:
        raise click.ClickException(str(exc)) from exc
    write_trace(trace, out)
    gen = trace.header.generator
    capped = (f" ({gen['sessions_dropped']} sessions dropped and {gen['sessions_cut']} cut by "
              "the context)") if "sessions_dropped" in gen else ""
    skipped = gen.get("runs_skipped", {}).get("count", 0)
    why = f"; {skipped} runs skipped: no model call (runs_skipped in the header)" \
        if skipped else ""
    click.echo(f"{out}: {len(trace.sessions)} sessions, {trace.num_turns} turns{capped}{why}")


@command.command("mini-swe-agent")
@click.argument("src", type=click.Path(exists=True, path_type=Path))
@_scaling_options(0.25, 0.1, 0.2, "Multiplies every time (tool gaps, session starts).", None)
@option("--strict", is_flag=True,
        help="Stop at a run that ended before any model call (exit status Timeout, "
             "InternalServerError...) instead of skipping and counting it.")
def mini_swe_agent_cmd(src: Path, model: str, token_scale: float, output_scale: float,
                       time_scale: float, max_gap: float | None, max_context: int,
                       max_turns: int | None, limit: int | None, real_sizes: bool,
                       out: Path, strict: bool) -> None:
    """Import mini-swe-agent trajectories: SRC is a folder (its *.traj.json, recursively), one
    .traj.json, or a .tar.gz of them (read in place). One session per run, one turn per model
    call, counted in the serving model's tokens and chat template (docs/replay.md). A run with
    no model call is skipped and counted; a malformed file is an error naming file and field."""
    from agentserving.replay.importers.mini_swe_agent import SweOptions, read_mini_swe_agent

    opts = SweOptions(model=model, limit=limit, strict=strict, scaling=_scaling(
        token_scale, output_scale, time_scale, max_gap, max_context, max_turns, real_sizes))
    tokenizer = _tokenizer(model)
    _import(lambda: read_mini_swe_agent(src, tokenizer, opts), out)


@command.command("mtrag")
@click.argument("src", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@option("--passages", type=click.Choice(["with-turn", "system"]), default="with-turn",
        help="Where the cut turn's retrieved passages go: into its user message (the history "
             "stays append-only) or into the system message of its prompt (a 'replace' turn: "
             "only the system prompt stays reusable).")
@_scaling_options(1.0, 0.1, round(1 / 60, 6),
                  "Multiplies every time: the human's pauses (minutes) and session starts; "
                  "the default turns a minute into a second.", 60.0)
def mtrag_cmd(src: Path, passages: str, model: str, token_scale: float, output_scale: float,
              time_scale: float, max_gap: float | None, max_context: int,
              max_turns: int | None, limit: int | None, real_sizes: bool, out: Path) -> None:
    """Import MTRAG-UN generation tasks (SRC: its reference.jsonl): one session per
    conversation, one turn per user message, the last one answered by the target."""
    from agentserving.replay.importers.mtrag import MtragOptions, read_mtrag

    opts = MtragOptions(model=model, layout=passages, limit=limit,  # type: ignore[arg-type]
                        scaling=_scaling(token_scale, output_scale, time_scale, max_gap,
                                         max_context, max_turns, real_sizes))
    tokenizer = _tokenizer(model)
    _import(lambda: read_mtrag(src, tokenizer, opts), out)


def _command_line(ctx: click.Context) -> str:
    """The invocation with every option spelled out: the file it wrote says how to remake it
    even once the defaults move."""
    words = ["agentserving", "trace", ctx.info_name or "agent-mix"]
    for param in ctx.command.params:
        if not isinstance(param, click.Option) or param.name is None:
            continue
        value = ctx.params.get(param.name)
        if value is None:
            continue
        words += [param.opts[0], str(value)]
    return " ".join(words)


mix_option = settings_option(MixOptions)


@command.command("agent-mix")
@mix_option("--swe", "swe_src", type=click.Path(exists=True, path_type=Path),
            help="mini-swe-agent trajectories (folder, .traj.json or .tar.gz).")
@mix_option("--mtrag", "mtrag_src", type=click.Path(exists=True, dir_okay=False, path_type=Path),
            help="MTRAG-UN's reference.jsonl.")
@mix_option("--mooncake", "mooncake_src",
            type=click.Path(exists=True, dir_okay=False, path_type=Path),
            help="Mooncake's conversation trace.")
@mix_option("--swe-sessions", type=click.IntRange(min=0),
            help="SWE agent sessions (seed 003: 300 of 1,999 trajectories, 59 % of its turns).")
@mix_option("--swe-turns", type=click.IntRange(min=1),
            help="Each SWE session's first N model calls.")
@mix_option("--swe-token-scale", type=click.FloatRange(min=0, min_open=True),
            help="Multiplies the SWE sessions' input lengths.")
@mix_option("--mtrag-sessions", type=click.IntRange(min=0),
            help="MTRAG conversations, multi-turn ones only (seed 003: 300, 18 % of its turns).")
@mix_option("--mtrag-passages", "mtrag_layout", type=click.Choice(["with-turn", "system"]),
            help="Where the MTRAG cut turn's passages go (see `trace mtrag --help`).")
@mix_option("--mooncake-sessions", type=click.IntRange(min=0),
            help="Mooncake chats with 2+ turns, standing in for seed 003's chat and "
                 "long-document share (LMSYS-Chat, WildChat, LongBench: 1,400, 23 % of its "
                 "turns).")
@mix_option("--mooncake-max-output", type=click.IntRange(min=1),
            help="Cap on every Mooncake output (its blocks are 256 tokens).")
@mix_option("--seed", type=int, help="Seeds the selection, the order and the arrivals.")
@mix_option("--arrival-rate", type=click.FloatRange(min=0, min_open=True),
            help="Sessions per second: one Poisson process over the whole mix.")
@mix_option("--chat-time-scale", type=click.FloatRange(min=0, min_open=True),
            help="Multiplies the human pauses of MTRAG and Mooncake sessions.")
@mix_option("--max-gap", "max_gap_s", type=click.FloatRange(min=0),
            help="Cap on every scaled human pause, seconds.")
@mix_option("--max-context", type=click.IntRange(min=1),
            help="Context cap of every session (the main job's per-pod vLLM context).")
@mix_option("--model", help=MODEL_HELP)
@option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True,
        help="Where to write the JSONL trace (the bundled one: "
             "replay/workloads/agent-mix.jsonl).")
@click.pass_context
def agent_mix_cmd(ctx: click.Context, out: Path, **fields: Any) -> None:
    """Build the agent mix: SWE agent sessions, MTRAG conversations and Mooncake chats in
    seed 003's proportions of turns, with seeded Poisson arrivals (the bundled `agent-mix`
    workload; docs/replay.md)."""
    from agentserving.replay.importers.agent_mix import build_mix

    opts = MixOptions(**fields)
    tokenizer = _tokenizer(opts.model)
    _import(lambda: build_mix(tokenizer, opts, command=_command_line(ctx)), out)


pressure_option = settings_option(PressureOptions)
_share = click.FloatRange(0, 1)


@command.command("agent-pressure")
@pressure_option("--swe", "swe_src", type=click.Path(exists=True, path_type=Path),
                 help="mini-swe-agent trajectories (folder, .traj.json or .tar.gz).")
@pressure_option("--sessions", type=click.IntRange(min=1),
                 help="Agent sessions, not counting their subagents.")
@pressure_option("--turns", type=click.IntRange(min=3), help="Each session's first N model "
                 "calls (within --max-context).")
@pressure_option("--token-scale", type=click.FloatRange(min=0, min_open=True),
                 help="Multiplies the sessions' input lengths.")
@pressure_option("--seed", type=int, help="Seeds the selection, pauses, resets, forks and "
                 "arrivals.")
@pressure_option("--arrival-rate", type=click.FloatRange(min=0, min_open=True),
                 help="Sessions per second (a Poisson process): all arrive within seconds.")
@pressure_option("--time-scale", type=click.FloatRange(min=0, min_open=True),
                 help="Multiplies every drawn pause (agentic: median 1.8 s; human: 25 s).")
@pressure_option("--reset-share", type=_share,
                 help="Share of sessions that reset their context once (at a turn drawn by "
                      "its context length).")
@pressure_option("--fork-share", type=_share, help="Share of sessions that fork subagents.")
@pressure_option("--fork-min-branches", type=click.IntRange(min=1),
                 help="Fewest subagents a forking session starts.")
@pressure_option("--fork-max-branches", type=click.IntRange(min=1),
                 help="Most subagents a forking session starts.")
@pressure_option("--branch-turns", type=click.IntRange(min=1), help="Each subagent's calls.")
@pressure_option("--fork-task-tokens", type=click.IntRange(min=1),
                 help="Tokens of the task each subagent starts with, after its parent's "
                      "context.")
@pressure_option("--max-context", type=click.IntRange(min=1),
                 help="Context cap of every session (the main job's per-pod vLLM context).")
@pressure_option("--model", help=MODEL_HELP)
@option("--kv-model", default="tiny",
        help="The served model whose KV bytes per token size the working set in the header "
             "(where its folder is prepared).")
@option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True,
        help="Where to write the JSONL trace (the bundled one: "
             "replay/workloads/agent-pressure.jsonl).")
@click.pass_context
def agent_pressure_cmd(ctx: click.Context, out: Path, kv_model: str, **fields: Any) -> None:
    """Build the pressure workload: real SWE agent sessions arriving together, with agentic
    and human pauses, context resets and subagent forks (the bundled `agent-pressure`
    workload; docs/replay.md)."""
    from agentserving.replay.importers.agent_pressure import build_pressure

    opts = PressureOptions(**fields)
    if opts.fork_min_branches > opts.fork_max_branches:
        raise click.BadParameter("at most --fork-max-branches", param_hint="--fork-min-branches")
    tokenizer = _tokenizer(opts.model)
    _import(lambda: build_pressure(tokenizer, opts, command=_command_line(ctx),
                                   kv_bytes_per_token=kv_bytes_per_token(kv_model)), out)


def kv_bytes_per_token(model: str) -> float | None:
    """KV bytes per token of a prepared model (None where its folder is not there)."""
    from agentserving.engine.kv.disk_probe import model_chunk_bytes
    from agentserving.engine.model.folders import folder_of

    folder = folder_of(model)
    if folder is None or not (folder / "config.json").exists():
        return None
    return model_chunk_bytes(folder, DEFAULT_CHUNK_SIZE) / DEFAULT_CHUNK_SIZE
