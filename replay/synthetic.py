"""Seeded, deterministic generator of synthetic agent sessions.

A session is one agent solving one task: a first turn with the agent's system prompt (shared,
as named blocks, by every session of the same agent kind) and the task, then turns that each
append one tool's result; every turn but the last ends in a tool call whose run time is the gap
before the next turn. Early turns favour reading/searching tools and late turns editing and
running tests. Some sessions fork a branch (a retry or reflection path) that shares the
parent's context up to the fork.

Everything is drawn from the distributions in a ``SyntheticConfig`` (log-normal, clamped), with
Python's ``random.Random`` seeded by a string per session: ``random()`` is the one part of the
module whose stream Python guarantees across versions, and the distributions here are computed
from it directly, so one seed gives the same trace on every machine. Session *i* has its own
stream, so generating more sessions never changes the first ones.

Where the numbers come from is in docs/replay.md ("Synthetic sessions"): the mean turns per
session and output tokens per turn of the ``agent`` preset match seed 003's evaluation; the
per-tool sizes and run times are stated assumptions. ``bench-agent``, the main job's workload,
keeps the prefix/append/output split of real coding-agent traffic (TraceLab) at token counts the
tiny CPU model can replay in the main job's budget; ``bench-small`` is an earlier, smaller-context
scaling that the simulator's tests use.
"""

from __future__ import annotations

import math
import random
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from agentserving.core.hashing import DEFAULT_CHUNK_SIZE
from agentserving.replay.tokens import DEFAULT_VOCAB_SIZE
from agentserving.replay.trace import ParentRef, Session, Trace, TraceHeader, Turn, TurnInput


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LogNormal(_Model):
    """``median * exp(sigma * N(0, 1))``, clamped to ``[lo, hi]``."""

    median: float = Field(gt=0)
    sigma: float = Field(ge=0)
    lo: float = 0.0
    hi: float | None = None

    def sample(self, rng: random.Random) -> float:
        x = max(self.lo, self.median * math.exp(self.sigma * _normal(rng)))
        return x if self.hi is None else min(self.hi, x)

    def sample_int(self, rng: random.Random) -> int:
        return int(round(self.sample(rng)))

    def mean(self) -> float:
        """Mean before clamping."""
        return self.median * math.exp(self.sigma ** 2 / 2)


def _normal(rng: random.Random) -> float:
    # Box-Muller on random() alone (the stream Python keeps stable across versions).
    u1 = 1.0 - rng.random()  # (0, 1]
    u2 = rng.random()
    return math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)


def _weighted(rng: random.Random, items: list[Any], weights: list[float]) -> Any:
    total = sum(weights)
    x = rng.random() * total
    for item, w in zip(items, weights, strict=True):
        x -= w
        if x < 0:
            return item
    return items[-1]


class ToolSpec(_Model):
    name: str
    weight_early: float = Field(ge=0, description="Choice weight on the first turn.")
    weight_late: float = Field(ge=0, description="Choice weight on the last turn.")
    result_tokens: LogNormal = Field(description="Tokens the result appends next turn.")
    run_s: LogNormal = Field(description="Seconds the tool runs (the tool-call gap).")


class AgentKind(_Model):
    name: str
    weight: float = Field(default=1.0, gt=0)
    system_blocks: int = Field(ge=0, description="Shared system prompt + tool schemas, blocks.")


class SyntheticConfig(_Model):
    name: str = "custom"
    sessions: int = Field(ge=1)
    seed: int = 0
    block_size: int = Field(default=512, gt=0)
    vocab_size: int = Field(default=DEFAULT_VOCAB_SIZE, gt=16)
    arrival_rate: float | None = Field(
        default=None, gt=0, description="Sessions/s (Poisson) for start_s; None: all at 0.")
    agents: list[AgentKind] = Field(min_length=1)
    turns: LogNormal
    task_tokens: LogNormal
    history_tokens: LogNormal | None = Field(
        default=None, description="Tokens of the run before the replayed window (first turn).")
    output_tokens: LogNormal
    tools: list[ToolSpec] = Field(min_length=1)
    branch_probability: float = Field(default=0.0, ge=0, le=1)
    branch_turns: LogNormal = LogNormal(median=2, sigma=0.3, lo=1, hi=4)
    max_context_tokens: int | None = Field(
        default=None, gt=0, description="End a session before its prompt would pass this.")


def _turns_for(cfg: SyntheticConfig, rng: random.Random, n: int, first_input: TurnInput,
               context: int) -> list[Turn]:
    """``n`` turns starting with ``first_input``; stops early at the context cap."""
    turns: list[Turn] = []
    inp = first_input
    for k in range(n):
        out = max(1, cfg.output_tokens.sample_int(rng))
        prompt = context + inp.num_tokens()
        if cfg.max_context_tokens is not None and prompt + out > cfg.max_context_tokens and turns:
            break
        last = k == n - 1
        phase = k / (n - 1) if n > 1 else 1.0
        tool = None if last else _weighted(
            rng, cfg.tools, [t.weight_early * (1 - phase) + t.weight_late * phase
                             for t in cfg.tools])
        gap = round(tool.run_s.sample(rng), 4) if tool else 0.0
        turns.append(Turn(input=inp, output_tokens=out, tool=tool.name if tool else None,
                          tool_gap_s=gap))
        context = prompt + out
        if tool is not None:
            inp = TurnInput(length=max(1, tool.result_tokens.sample_int(rng)))
    if turns:  # the session ends on the last turn kept: it calls no tool
        turns[-1] = turns[-1].model_copy(update={"tool": None, "tool_gap_s": 0.0})
    return turns


def _session(cfg: SyntheticConfig, i: int) -> list[Session]:
    rng = random.Random(f"agentserving.synthetic/{cfg.seed}/session/{i}")
    agent = _weighted(rng, cfg.agents, [a.weight for a in cfg.agents])
    n = max(1, cfg.turns.sample_int(rng))
    task = max(1, cfg.task_tokens.sample_int(rng))
    if cfg.history_tokens is not None:  # drawn only when set: other presets keep their streams
        task += max(0, cfg.history_tokens.sample_int(rng))
    system = [f"sys/{agent.name}/{j}" for j in range(agent.system_blocks)]
    first = TurnInput(length=len(system) * cfg.block_size + task, block_ids=system)
    sid = f"s{i}"
    turns = _turns_for(cfg, rng, n, first, 0)
    out = [Session(session_id=sid, turns=turns, meta={"agent": agent.name})]
    if len(turns) >= 2 and rng.random() < cfg.branch_probability:
        fork = int(rng.random() * (len(turns) - 1))  # fork after a turn that called a tool
        parent_turn = turns[fork]
        context = sum(t.input.num_tokens() + t.num_output_tokens() for t in turns[: fork + 1])
        tool = next(t for t in cfg.tools if t.name == parent_turn.tool)
        b_turns = _turns_for(cfg, rng, max(1, cfg.branch_turns.sample_int(rng)),
                             TurnInput(length=max(1, tool.result_tokens.sample_int(rng))),
                             context)
        if b_turns:
            out.append(Session(
                session_id=f"{sid}.b{fork}",
                parent=ParentRef(session_id=sid, turn=fork, gap_s=parent_turn.tool_gap_s),
                turns=b_turns, meta={"agent": agent.name, "branch": True}))
    return out


def generate(cfg: SyntheticConfig) -> Trace:
    """The trace ``cfg`` describes; the same config always gives the same trace."""
    sessions: list[Session] = []
    arrivals = random.Random(f"agentserving.synthetic/{cfg.seed}/arrivals")
    t = 0.0
    for i in range(cfg.sessions):
        group = _session(cfg, i)
        if cfg.arrival_rate is not None:
            if i > 0:
                t += -math.log(1.0 - arrivals.random()) / cfg.arrival_rate
            group[0] = group[0].model_copy(update={"start_s": round(t, 4)})
        else:
            group[0] = group[0].model_copy(update={"start_s": 0.0})
        sessions.extend(group)
    header = TraceHeader(block_size=cfg.block_size, vocab_size=cfg.vocab_size,
                         source=f"synthetic:{cfg.name}",
                         generator=cfg.model_dump(mode="json"))
    return Trace(header=header, sessions=sessions)


# ------------------------------------------------------------------------------------ presets

# Tool shapes of a coding agent (SWE-agent/OpenHands-like). Sizes and run times are
# assumptions (docs/replay.md); the early->late shift follows published characterizations.
_AGENT_TOOLS = [
    ToolSpec(name="read_file", weight_early=0.35, weight_late=0.15,
             result_tokens=LogNormal(median=900, sigma=0.8, lo=50, hi=8000),
             run_s=LogNormal(median=0.05, sigma=0.5, lo=0.01, hi=1)),
    ToolSpec(name="search", weight_early=0.35, weight_late=0.05,
             result_tokens=LogNormal(median=400, sigma=0.8, lo=20, hi=4000),
             run_s=LogNormal(median=0.6, sigma=0.7, lo=0.05, hi=10)),
    ToolSpec(name="bash", weight_early=0.2, weight_late=0.2,
             result_tokens=LogNormal(median=300, sigma=1.0, lo=10, hi=6000),
             run_s=LogNormal(median=1.5, sigma=1.0, lo=0.05, hi=60)),
    ToolSpec(name="edit_file", weight_early=0.05, weight_late=0.3,
             result_tokens=LogNormal(median=80, sigma=0.6, lo=10, hi=1000),
             run_s=LogNormal(median=0.1, sigma=0.5, lo=0.01, hi=2)),
    ToolSpec(name="run_tests", weight_early=0.05, weight_late=0.3,
             result_tokens=LogNormal(median=1200, sigma=0.8, lo=50, hi=8000),
             run_s=LogNormal(median=8.0, sigma=0.8, lo=0.5, hi=120)),
]


def agent_preset(sessions: int = 200, seed: int = 0) -> SyntheticConfig:
    """Full-size agent sessions (for accelerators and the simulator)."""
    return SyntheticConfig(
        name="agent", sessions=sessions, seed=seed, block_size=512, arrival_rate=0.5,
        agents=[AgentKind(name="coder", weight=0.6, system_blocks=6),
                AgentKind(name="assistant", weight=0.4, system_blocks=2)],
        # median 5, sigma 0.7: mean 6.4 turns per session (seed 003: 12,740 / 1,999 = 6.37)
        turns=LogNormal(median=5, sigma=0.7, lo=1, hi=50),
        task_tokens=LogNormal(median=300, sigma=0.8, lo=20, hi=4000),
        # median 150, sigma 0.6: mean 180 tokens (seed 003: 375.64 tok/s / 2.075 req/s = 181)
        output_tokens=LogNormal(median=150, sigma=0.6, lo=8, hi=2048),
        tools=_AGENT_TOOLS, branch_probability=0.1,
        branch_turns=LogNormal(median=2, sigma=0.5, lo=1, hi=8),
        max_context_tokens=32768,
    )


def _scaled_tools(size: float, time: float, size_cap: float) -> list[ToolSpec]:
    out = []
    for t in _AGENT_TOOLS:
        r, g = t.result_tokens, t.run_s
        out.append(t.model_copy(update={
            "result_tokens": LogNormal(median=r.median * size, sigma=min(r.sigma, 0.6),
                                       lo=max(8, r.lo * size),
                                       hi=min(size_cap, (r.hi or size_cap) * size)),
            "run_s": LogNormal(median=g.median * time, sigma=min(g.sigma, 0.6),
                               lo=g.lo * time, hi=min(2.0, (g.hi or 2.0) * time))}))
    return out


def _cpu_preset(**shape: Any) -> SyntheticConfig:
    """What both main-job presets share: the agent mix (a coder with the larger system prompt,
    tool schemas included, and an assistant), blocks of one KV chunk so shared prompts are
    whole chunks, the task sizes and the branching; ``shape`` is each preset's own."""
    return SyntheticConfig(
        block_size=DEFAULT_CHUNK_SIZE,
        agents=[AgentKind(name="coder", weight=0.6, system_blocks=8),
                AgentKind(name="assistant", weight=0.4, system_blocks=6)],
        task_tokens=LogNormal(median=200, sigma=0.4, lo=64, hi=400), branch_probability=0.15,
        branch_turns=LogNormal(median=2, sigma=0.3, lo=1, hi=3), **shape)


def bench_small_preset(sessions: int = 14, seed: int = 2) -> SyntheticConfig:
    """The main job's workload: the ``agent`` shape scaled to the tiny CPU model.

    What makes agent serving different, kept: a large shared system prompt (tool schemas
    included), contexts that grow by a few hundred tokens per turn, short outputs. Scaled so a
    replay takes about a minute on 2 cores: contexts of ~1.5-4k tokens, outputs of 8-24,
    tool results at a quarter and tool times at a fifth of the ``agent`` preset's, 256-token
    blocks so that shared prompts are whole KV chunks.
    """
    return _cpu_preset(
        name="bench-small", sessions=sessions, seed=seed, arrival_rate=2.0,
        turns=LogNormal(median=7, sigma=0.3, lo=4, hi=9),
        output_tokens=LogNormal(median=10, sigma=0.3, lo=8, hi=24),
        tools=_scaled_tools(size=0.25, time=0.2, size_cap=500), max_context_tokens=4096,
    )


def bench_agent_preset(sessions: int = 12, seed: int = 1) -> SyntheticConfig:
    """The main job's workload: windows of long coding-agent runs, token counts scaled 1/25.

    TraceLab's public pool of real Claude Code / Codex sessions (357k agent steps) averages,
    per step, 147k cached-prefix tokens, 6.6k appended and 523 output tokens: contexts ~23x the
    append and ~290x the output. Divided by 25 that is ~5.9k / ~260 / ~21, what the tiny CPU
    model can replay in the main job's budget. Each session is a window of 6-10 turns of such
    a run: its first turn carries the shared system prompt + tool schemas, the task and the
    run so far (~2.5k tokens of history, which no system has cached), every later turn appends
    one tool result and emits a short tool call. docs/replay.md lists every number's source.
    """
    return _cpu_preset(
        name="bench-agent", sessions=sessions, seed=seed, arrival_rate=0.5,
        turns=LogNormal(median=7, sigma=0.2, lo=6, hi=10),
        history_tokens=LogNormal(median=2500, sigma=0.3, lo=1200, hi=4000),
        # TraceLab's 523 output tokens per step / 40 (not / 25): on this CPU a decode token
        # costs ~100 prefill tokens' time, on a GPU fleet ~5 (docs/replay.md), so even this
        # leaves decode a larger share of a turn than in production
        output_tokens=LogNormal(median=12, sigma=0.4, lo=6, hi=32),
        # append: TraceLab 6.6k per step / 25 = 260 (tool results at 0.3x the agent preset's)
        tools=_scaled_tools(size=0.3, time=0.2, size_cap=900), max_context_tokens=8192,
    )


PRESETS = {"agent": agent_preset, "bench-small": bench_small_preset,
           "bench-agent": bench_agent_preset}


def generate_preset(name: str, **overrides: Any) -> Trace:
    """Generate a named preset; ``overrides`` replace its ``SyntheticConfig`` fields."""
    try:
        factory = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None
    cfg = factory()
    if overrides:
        cfg = SyntheticConfig.model_validate({**cfg.model_dump(), **overrides})
    return generate(cfg)
