"""``agent-mix``: real SWE agent sessions, RAG conversations and chats in one workload.

Seed 003 replays 1,999 trajectories: LMSYS-Chat 600, WildChat 600, MTRAG 300, SWE-bench 300,
LongBench 200, 12,740 turns in all. The mix takes its three kinds of traffic from the real traces
we hold, in seed 003's proportions of turns (each turn is one model call, the unit the fleet
serves; the trajectories' counts would weigh a 2-turn chat as much as a 25-call agent run):

- **chat and long documents**: Mooncake's conversation trace, real production chat with long
  prompts (``mooncake``), for LMSYS-Chat (2.0 turns per conversation on average, as its
  dataset paper gives), WildChat (2.54) and LongBench (single-turn): 2,924 turns, 23 %;
- **multi-turn RAG**: MTRAG-UN's human conversations (``mtrag``), for MTRAG (7.7 turns per
  conversation): 2,310 turns, 18 %;
- **coding agents**: mini-swe-agent's SWE-bench runs (``mini_swe_agent``), for SWE-bench: the
  rest, 7,506 turns (25 calls per trajectory), 59 %. Each session keeps its first
  ``swe_turns`` calls at their real sizes (``swe_token_scale`` 1: the first calls of a run fit
  the context as they are, and their long context against short appends is what cross-turn
  reuse is about; scaled by 0.25 they would be 1.2k-token prompts).

So 7 SWE sessions of 14 calls, 6 MTRAG conversations and 16 Mooncake chats by default: 97 /
29 / 41 turns (58 / 17 / 25 %). Sessions are drawn with a seeded generator (only multi-turn
conversations and chats: single-turn ones exercise no cross-turn reuse), sized by each
importer's defaults but for the SWE token scale (SWE: outputs × 0.1, tool times × 0.2; MTRAG:
tokens × 1, outputs × 0.1; Mooncake: 256-token blocks, outputs ≤ 16) within the context, and
arrive as one seeded Poisson process over the whole mix in a seeded random order. Human pauses
(MTRAG's between a reply and the next question, Mooncake's between requests: minutes) are
scaled by ``chat_time_scale`` and capped at ``max_gap_s``, so a chat's later turns come a few
seconds after its first and the main job's throughput measures the fleet, not people
thinking. The header records the command, the sources, the selection and the scaling; the
sessions hold counts, block ids and times only, no text.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from agentserving.core.hashing import DEFAULT_CHUNK_SIZE
from agentserving.engine.model.tokenizer import Tokenizer
from agentserving.replay.importers import mini_swe_agent, mtrag
from agentserving.replay.importers.scaling import MAIN_JOB_CONTEXT, fit_session
from agentserving.replay.mooncake import MooncakeOptions, read_mooncake
from agentserving.replay.trace import Session, Trace, TraceHeader

SOURCE = "agent-mix"
DATA = Path("../shared/data")
# seed 003's turns by kind (see the module docstring): what the mix's proportions follow
SEED_003_MIX = {"chat and long documents (Mooncake)": 2924, "MTRAG": 2310, "SWE-bench": 7506}


@dataclass(frozen=True)
class MixOptions:
    swe_src: Path = DATA / "mini-swe-agent/deepseek-swebench-pr814.tar.gz"
    mtrag_src: Path = DATA / "mtrag/mtragun-reference.jsonl"
    mooncake_src: Path = DATA / "mooncake/conversation_trace.jsonl"
    swe_sessions: int = 7
    swe_turns: int = 14
    swe_token_scale: float = 1.0  # the first calls fit the context at their real sizes
    mtrag_sessions: int = 6
    mooncake_sessions: int = 16
    seed: int = 6  # the bundled draw: 167 turns, 509k prompt tokens, arrivals over 31 s
    arrival_rate: float = 1.0  # sessions per second over the whole mix
    model: str = "smollm2"
    max_context: int = MAIN_JOB_CONTEXT
    mtrag_layout: mtrag.Layout = "with-turn"
    mooncake_max_output: int = 16
    chat_time_scale: float = round(1 / 300, 6)
    max_gap_s: float = 2.0


def _rng(opts: MixOptions, what: str) -> random.Random:
    return random.Random(f"agentserving.replay/agent-mix/{opts.seed}/{what}")


def swe_sessions(tokenizer: Tokenizer, opts: MixOptions) -> tuple[list[Session], dict[str, Any]]:
    scaling = replace(mini_swe_agent.DEFAULT_SCALING, max_turns=opts.swe_turns,
                      token_scale=opts.swe_token_scale, max_context=opts.max_context)
    kept = mini_swe_agent.drawn_sessions(tokenizer, opts.swe_src, scaling, _rng(opts, "swe"),
                                         opts.swe_sessions)
    info = mini_swe_agent.generator(tokenizer, mini_swe_agent.SweOptions(
        model=opts.model, scaling=scaling))
    return kept, {**info, "src": str(opts.swe_src), "sessions": [s.session_id for s in kept]}


def mtrag_sessions(tokenizer: Tokenizer, opts: MixOptions) -> tuple[list[Session], dict[str, Any]]:
    scaling = replace(mtrag.DEFAULT_SCALING, time_scale=opts.chat_time_scale,
                      max_gap_s=opts.max_gap_s, max_context=opts.max_context)
    multi_turn = [c for c in mtrag.read_conversations(opts.mtrag_src)
                  if sum(who == "user" for who, _, _ in c.messages) >= 2]
    _rng(opts, "mtrag").shuffle(multi_turn)
    kept: list[Session] = []
    for conv in multi_turn:
        if len(kept) >= opts.mtrag_sessions:
            break
        imported = mtrag.import_conversation(tokenizer, conv, opts.mtrag_layout)
        session, _ = fit_session(imported, scaling, namespace=mtrag.SOURCE,
                                 block_size=DEFAULT_CHUNK_SIZE)
        if session is not None:
            kept.append(session)
    info = mtrag.generator(tokenizer, mtrag.MtragOptions(
        model=opts.model, layout=opts.mtrag_layout, scaling=scaling))
    return kept, {**info, "src": str(opts.mtrag_src), "sessions": [s.session_id for s in kept]}


def mooncake_sessions(opts: MixOptions) -> tuple[list[Session], dict[str, Any]]:
    block = DEFAULT_CHUNK_SIZE
    # a 512-token hash block becomes `block` tokens: keep requests that then fit with output
    max_input = (opts.max_context - opts.mooncake_max_output) * 512 // block
    moon = MooncakeOptions(block_tokens=block, max_output_tokens=opts.mooncake_max_output,
                           max_input_tokens=max_input)
    trace = read_mooncake(opts.mooncake_src, moon)
    chats = [s for s in trace.sessions if s.parent is None and len(s.turns) >= 2]
    chosen = sorted(_rng(opts, "mooncake").sample(chats, min(opts.mooncake_sessions,
                                                             len(chats))),
                    key=lambda s: s.session_id)
    out = []
    for s in chosen:  # the human's pauses, scaled and capped, as the turns' offsets
        t0 = s.turns[0].timestamp_s or 0.0
        turns, at, prev = [], 0.0, t0
        for t in s.turns:
            at += min((t.timestamp_s or prev) - prev, opts.max_gap_s / opts.chat_time_scale) \
                * opts.chat_time_scale
            prev = t.timestamp_s or prev
            turns.append(t.model_copy(update={"timestamp_s": round(at, 4)}))
        out.append(s.model_copy(update={"turns": turns, "start_s": 0.0}))
    info = {"reader": "agentserving.replay.mooncake", **asdict(moon),
            "time_scale": opts.chat_time_scale, "max_gap_s": opts.max_gap_s,
            "src": str(opts.mooncake_src), "sessions": [s.session_id for s in out]}
    return out, info


def arrivals(n: int, rate: float, rng: random.Random) -> list[float]:
    """A Poisson process of ``rate`` per second: the first arrival at 0."""
    out, t = [], 0.0
    for i in range(n):
        if i:
            t += -math.log(1.0 - rng.random()) / rate
        out.append(round(t, 4))
    return out


def _arrive(session: Session, start: float, source: str) -> Session:
    """The session under the mix's id, starting at ``start`` (its turns' planned times move
    with it)."""
    turns = [t.model_copy(update={"timestamp_s": round(start + t.timestamp_s, 4)})
             if t.timestamp_s is not None else t for t in session.turns]
    return session.model_copy(update={"session_id": f"{source}/{session.session_id}",
                                      "start_s": start, "turns": turns})


def build_mix(tokenizer: Tokenizer, opts: MixOptions, *, command: str) -> Trace:
    swe, swe_info = swe_sessions(tokenizer, opts)
    rag, rag_info = mtrag_sessions(tokenizer, opts)
    chat, chat_info = mooncake_sessions(opts)
    tagged = [(mini_swe_agent.SOURCE, s) for s in swe] + [(mtrag.SOURCE, s) for s in rag] + \
        [("mooncake", s) for s in chat]
    _rng(opts, "order").shuffle(tagged)
    starts = arrivals(len(tagged), opts.arrival_rate, _rng(opts, "arrivals"))
    sessions = [_arrive(s, t, source) for (source, s), t in zip(tagged, starts, strict=True)]
    generator = {
        "command": command, "builder": "agentserving.replay.importers.agent_mix",
        "seed": opts.seed, "arrival_rate": opts.arrival_rate, "model": opts.model,
        "template": tokenizer.template_id, "max_context": opts.max_context,
        "seed_003_mix": SEED_003_MIX,
        "sources": {mini_swe_agent.SOURCE: swe_info, mtrag.SOURCE: rag_info,
                    "mooncake": chat_info},
    }
    return Trace(header=TraceHeader(block_size=DEFAULT_CHUNK_SIZE, source=SOURCE,
                                    generator=generator), sessions=sessions)
