"""``agent-pressure``: many coding-agent sessions at once, pausing as agents and people do.

The agent mix (``agent_mix``) never strains a pod's memory: its tools return within a second
and a pod's DRAM turns over in ten, so KV never has to leave DRAM between a session's turns.
Real agent fleets are not like that. This workload keeps the mix's real SWE-bench sessions
(mini-swe-agent with DeepSeek: its real prompts, tool results and replies, counted in the
serving model's tokens) and gives them the pauses, resets and forks public figures report
for agentic coding:

- **pauses**: before each turn after the first, an agentic pause (the model's tool running;
  ``AGENTIC``: 70 % of turns, median 1.8 s, mean 2.5 s, at most 10 s) or a human one (the user
  reading and answering; ``HUMAN``: 30 %, median 25 s, mean 40 s, at most 120 s): AIPerf's
  agentic-code distribution, from SemiAnalysis's Claude Code traces. Each is drawn from a
  log-normal with that median and mean, capped, then multiplied by ``time_scale``. The turn
  after it says which (``meta.pause``: ``agentic`` or ``human``).
- **resets**: about 1 % of sessions reset their context, more as it grows (``reset_share``
  5 %: these sessions are long, twelve calls up to the whole context):
  at a turn drawn with a weight of its context length, the prompt becomes the session's first
  input again plus a summary of a tenth of the context so far (a ``replace`` turn,
  ``meta.reset``).
- **subagents**: a share of the sessions (``fork_share``: 44 %, as vLLM's AgentX traces
  report) fork 2-8 subagents (``fork_min_branches`` to ``fork_max_branches``) after a turn
  drawn from their second to their last but one: each a session of its own (``parent``) that
  starts from the parent's context with a task of its own (``fork_task_tokens``) and then runs
  the first calls of another real SWE session's tool loop (its appends and outputs, pauses
  drawn as above). The parent goes on after its own pause; it does not wait for them.
- **at once**: every session arrives within seconds (a Poisson process of ``arrival_rate``), so
  dozens share each pod, and their working set (every session's longest context, the
  branches' own tokens beside their parent's) is many times a pod's DRAM tier: the header
  records it in tokens (``working_set_tokens``) and, for the served model, in GiB with the
  largest DRAM tier of the whole fleet that is at most a third of it
  (``fleet_dram_gib_at_most``: a run gives each pod that over the pod count, or less).

Everything is drawn from seeded generators (``seed``); the header records the command, the
source, every parameter and the counts. Sessions hold counts, block ids and times only.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from agentserving.core.hashing import DEFAULT_CHUNK_SIZE
from agentserving.engine.model.tokenizer import Tokenizer
from agentserving.replay.importers import mini_swe_agent
from agentserving.replay.importers.agent_mix import DATA, arrivals
from agentserving.replay.importers.scaling import MAIN_JOB_CONTEXT
from agentserving.replay.tokens import DEFAULT_VOCAB_SIZE
from agentserving.replay.trace import (
    InputPart,
    ParentRef,
    Session,
    Trace,
    TraceHeader,
    Turn,
    TurnInput,
    expand_input,
)

SOURCE = "agent-pressure"
DONORS = 8  # further real sessions whose tool loops the subagents run


@dataclass(frozen=True)
class Pause:
    """One kind of pause between turns: a log-normal of this median and mean, capped."""

    share: float
    median_s: float
    mean_s: float
    max_s: float

    def draw(self, rng: random.Random) -> float:
        mu = math.log(self.median_s)
        sigma = math.sqrt(2 * math.log(self.mean_s / self.median_s))
        return min(rng.lognormvariate(mu, sigma), self.max_s)


# AIPerf's agentic-code distribution (SemiAnalysis's Claude Code traces)
AGENTIC = Pause(share=0.7, median_s=1.8, mean_s=2.5, max_s=10.0)
HUMAN = Pause(share=0.3, median_s=25.0, mean_s=40.0, max_s=120.0)


@dataclass(frozen=True)
class PressureOptions:
    swe_src: Path = DATA / "mini-swe-agent/deepseek-swebench-pr814.tar.gz"
    sessions: int = 48
    turns: int = 12  # each session's first N model calls
    token_scale: float = 1.0
    seed: int = 1
    arrival_rate: float = 4.0  # sessions per second
    time_scale: float = 0.5  # multiplies every pause
    # about 1 % of all sessions, more as the context grows: these run 12 calls at up to the
    # whole context, and 48 sessions at 1 % would hold none
    reset_share: float = 0.05
    fork_share: float = 0.44
    fork_min_branches: int = 2
    fork_max_branches: int = 8
    branch_turns: int = 4  # each subagent's calls
    fork_task_tokens: int = 200
    model: str = "smollm2"
    max_context: int = MAIN_JOB_CONTEXT


def _rng(opts: PressureOptions, what: str) -> random.Random:
    return random.Random(f"agentserving.replay/agent-pressure/{opts.seed}/{what}")


def pause(rng: random.Random, time_scale: float) -> tuple[str, float]:
    """(kind, seconds) of one pause between turns."""
    kind = AGENTIC if rng.random() < AGENTIC.share else HUMAN
    return ("agentic" if kind is AGENTIC else "human"), round(kind.draw(rng) * time_scale, 4)


def real_sessions(tokenizer: Tokenizer, opts: PressureOptions, count: int) -> list[Session]:
    """``count`` real SWE sessions in a seeded order, each cut to ``turns`` calls and the
    context (runs that made no model call skipped)."""
    scaling = replace(mini_swe_agent.DEFAULT_SCALING, max_turns=opts.turns,
                      token_scale=opts.token_scale, max_context=opts.max_context)
    return mini_swe_agent.drawn_sessions(tokenizer, opts.swe_src, scaling, _rng(opts, "swe"),
                                         count, min_turns=3)


def with_pauses(turns: list[Turn], rng: random.Random, time_scale: float) -> list[Turn]:
    """The turns with a drawn pause before each after the first (the previous turn's gap).
    A turn before a human pause ended without a tool call (the agent handed back to its
    user), so it names no tool: what a client tells the server (a tool call in the answer, or
    none) says which kind of pause follows."""
    out = [t.model_copy(deep=True) for t in turns]
    for k in range(1, len(out)):
        kind, gap = pause(rng, time_scale)
        out[k - 1].tool_gap_s = gap
        if kind == "human":
            out[k - 1].tool = None
        out[k].meta["pause"] = kind
    out[-1].tool_gap_s = 0.0
    return out


def contexts(turns: list[Turn]) -> list[int]:
    """Each turn's prompt length in tokens (counts only: the append rule of the trace)."""
    out, context = [], 0
    for t in turns:
        n = t.input.num_tokens()
        context = n if t.context == "replace" else context + n
        out.append(context)
        context += t.output_tokens or 0
    return out


def with_reset(turns: list[Turn], rng: random.Random, session_id: str) -> list[Turn]:
    """The session's context reset at a turn drawn by its context length: that prompt is the
    first input again plus a summary of a tenth of the context so far."""
    sizes = contexts(turns)
    k = rng.choices(range(2, len(turns)), weights=sizes[2:])[0]
    summary = max(1, (sizes[k - 1] + (turns[k - 1].output_tokens or 0)) // 10)
    # the first prompt's very tokens (its own text is keyed by its turn: named again here, it
    # would be other tokens), then the summary
    head = InputPart(token_ids=expand_input(turns[0].input, f"input/{session_id}/0",
                                            block_size=DEFAULT_CHUNK_SIZE,
                                            vocab_size=DEFAULT_VOCAB_SIZE))
    summary_part = InputPart(length=summary + turns[k].input.num_tokens(),
                             block_ids=[f"{SOURCE}/summary/{session_id}"])
    out = list(turns)
    out[k] = turns[k].model_copy(update={
        "input": TurnInput(parts=[head, summary_part]), "context": "replace",
        "meta": {**turns[k].meta, "reset": True}})
    return out


def branches(parent: Session, donors: list[Session], rng: random.Random,
             opts: PressureOptions) -> list[Session]:
    """2-8 subagents forked after a drawn turn of ``parent``, each running a donor's calls."""
    at = rng.randrange(1, len(parent.turns) - 1)
    count = rng.randint(opts.fork_min_branches, opts.fork_max_branches)
    sizes = contexts(parent.turns)
    room = opts.max_context - sizes[at] - (parent.turns[at].output_tokens or 0)
    out = []
    for b in range(count):
        donor = rng.choice(donors)
        sid = f"{parent.session_id}/sub-{b}"
        task = Turn(input=TurnInput(length=opts.fork_task_tokens), output_tokens=
                    donor.turns[0].output_tokens, meta={"subagent": b})
        turns = [task, *(t.model_copy(update={"meta": {}}) for t in
                         donor.turns[1:opts.branch_turns])]
        kept, used = [], 0
        for t in turns:  # within what the parent's context leaves
            used += t.input.num_tokens() + (t.output_tokens or 0)
            if used > room:
                break
            kept.append(t)
        if not kept:
            continue
        gap = round(AGENTIC.draw(rng) * opts.time_scale, 4)  # the parent's call starting it
        out.append(Session(session_id=sid, parent=ParentRef(
            session_id=parent.session_id, turn=at, gap_s=gap),
            turns=with_pauses(kept, rng, opts.time_scale),
            meta={"source": SOURCE, "subagent_of": parent.session_id}))
    return out


def working_set(sessions: list[Session]) -> int:
    """Tokens of KV the sessions hold at their longest: each root's longest context, each
    branch's own tokens (its parent's prefix is the parent's)."""
    total = 0
    for s in sessions:
        sizes = contexts(s.turns)
        total += max(n + (t.output_tokens or 0) for n, t in zip(sizes, s.turns, strict=True))
    return total


def build_pressure(tokenizer: Tokenizer, opts: PressureOptions, *, command: str,
                   kv_bytes_per_token: float | None = None) -> Trace:
    rng = _rng(opts, "shape")
    found = real_sessions(tokenizer, opts, opts.sessions + DONORS)
    roots, donors = found[:opts.sessions], found[opts.sessions:] or found
    starts = arrivals(len(roots), opts.arrival_rate, _rng(opts, "arrivals"))
    sessions: list[Session] = []
    forks = resets = 0
    for root, start in zip(roots, starts, strict=True):
        sid = f"{SOURCE}/{root.session_id}"
        turns = with_pauses(root.turns, rng, opts.time_scale)
        if rng.random() < opts.reset_share:
            turns = with_reset(turns, rng, sid)
            resets += 1
        parent = Session(session_id=sid, start_s=start, turns=turns,
                         meta={**root.meta, "source": SOURCE})
        sessions.append(parent)
        if rng.random() < opts.fork_share:
            sessions += branches(parent, donors, rng, opts)
            forks += 1
    tokens = working_set(sessions)
    pauses = [t.meta["pause"] for s in sessions for t in s.turns if "pause" in t.meta]
    generator: dict[str, Any] = {
        "command": command, "builder": "agentserving.replay.importers.agent_pressure",
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(opts).items()},
        "pauses": {"agentic": asdict(AGENTIC), "human": asdict(HUMAN),
                   "drawn": {k: pauses.count(k) for k in ("agentic", "human")}},
        "template": tokenizer.template_id,
        "roots": len(roots), "subagents": len(sessions) - len(roots), "forking_roots": forks,
        "resets": resets, "working_set_tokens": tokens,
    }
    if kv_bytes_per_token:  # and the largest DRAM tier, over the whole fleet, a third of it
        generator["working_set_gib"] = round(tokens * kv_bytes_per_token / 2**30, 4)
        generator["fleet_dram_gib_at_most"] = round(generator["working_set_gib"] / 3, 4)
    return Trace(header=TraceHeader(block_size=DEFAULT_CHUNK_SIZE, source=SOURCE,
                                    generator=generator), sessions=sessions)
